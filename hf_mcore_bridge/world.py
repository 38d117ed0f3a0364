"""Starting a local process world for megatron-core: one process per rank, gloo on CPU, NCCL on GPU.

`run_world(fn, layout, *args)` spawns TP x PP x EP processes; each initialises `torch.distributed` and
megatron-core's `parallel_state` for the layout (CPU workarounds applied where CUDA is absent), calls
`fn(*args)`, and tears down. `fn` must be importable (a module-level function). A failing rank becomes a
`BridgeError` carrying the rank's last error line.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import torch

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.layout import Layout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def world_size(layout: Layout) -> int:
    """Ranks a layout needs with no data parallelism."""
    return layout.tp * layout.pp * layout.cp * layout.ep


def device() -> torch.device:
    """This rank's device."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_world(fn: Callable[..., None], layout: Layout, *args: Any) -> None:
    """Run `fn(*args)` on every rank of a fresh world for `layout`."""
    import torch.multiprocessing as mp

    size = world_size(layout)
    context = mp.start_processes(
        _rank_main, args=(size, _free_port(), layout, fn, args), nprocs=size, join=False, start_method="spawn"
    )
    try:
        while not context.join():
            pass
    except mp.ProcessRaisedException as err:
        text = str(err).strip()
        detail = text if os.environ.get("BRIDGE_DEBUG") == "1" else text.splitlines()[-1]
        raise BridgeError(f"a megatron-core rank failed: {detail}") from None
    except mp.ProcessExitedException as err:
        raise BridgeError(f"a megatron-core rank died: {err}") from None


def _rank_main(rank: int, size: int, port: int, layout: Layout, fn: Callable[..., None], args: tuple) -> None:
    import torch.distributed as dist

    from hf_mcore_bridge.megatron_cpu import apply_cpu_workarounds, apply_te_absent_workarounds
    from hf_mcore_bridge.quiet import quiet_libraries

    quiet_libraries()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    apply_cpu_workarounds()
    apply_te_absent_workarounds()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )
    if cuda:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    try:
        fn(*args)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
