"""Starting a local process world for megatron-core: one process per rank, gloo on CPU, NCCL on GPU.

`run_world(fn, layout, *args)` spawns TP x PP x CP x EP processes (or `world=` processes: the data-parallel size
is then `world / (TP x PP x CP)`, megatron-core's rule); each initialises `torch.distributed` and megatron-core's
`parallel_state` for the layout (CPU workarounds applied where CUDA is absent), calls `fn(*args)`, and tears
down. `fn` must be importable (a module-level function). A failing rank becomes a `BridgeError` carrying the
rank's last error line; an interrupt (Ctrl-C) stops every rank and is raised again in the parent.
`run_torch_world(fn, size, *args)` starts the same kind of world without megatron-core's state, for backends
that lay out their own device mesh (DTensor).
"""

from __future__ import annotations

import os
import signal
import socket
import threading
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
    """Ranks a layout needs by default: TP x PP x CP x EP (the experts' ranks double as data-parallel replicas)."""
    return layout.tp * layout.pp * layout.cp * layout.ep


def check_world(layout: Layout, world: int) -> None:
    """Raise `BridgeError` unless megatron-core can lay `layout` out over `world` ranks."""
    dense = layout.tp * layout.pp * layout.cp
    expert = layout.expert_tp * layout.ep * layout.pp
    if world < 1 or world % dense or world % expert:
        raise BridgeError(
            f"{world} ranks cannot hold {layout}: the world must be a multiple of tp*pp*cp={dense}"
            f" and of etp*ep*pp={expert}"
        )


def device() -> torch.device:
    """This rank's device."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_world(fn: Callable[..., None], layout: Layout, *args: Any, world: int | None = None) -> None:
    """Run `fn(*args)` on every rank of a fresh world for `layout` (`world` ranks; None: `world_size(layout)`)."""
    size = world_size(layout) if world is None else world
    check_world(layout, size)
    _spawn(size, layout, fn, args)


def run_torch_world(fn: Callable[..., None], size: int, *args: Any) -> None:
    """Run `fn(*args)` on `size` ranks with `torch.distributed` initialised and no megatron-core state (worlds
    laid out by the caller, e.g. DTensor device meshes)."""
    _spawn(size, None, fn, args)


def _spawn(size: int, layout: Layout | None, fn: Callable[..., None], args: tuple) -> None:
    import torch.multiprocessing as mp

    # The ranks start with SIGINT ignored (the disposition survives spawn's exec): Ctrl-C reaches the whole process
    # group, and without this every rank would print its own KeyboardInterrupt traceback. The parent stops them.
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if in_main_thread else None
    try:
        context = mp.start_processes(
            _rank_main, args=(size, _free_port(), layout, fn, args), nprocs=size, join=False, start_method="spawn"
        )
    finally:
        if in_main_thread:
            signal.signal(signal.SIGINT, previous)
    try:
        while not context.join():
            pass
    except KeyboardInterrupt:
        _stop(context)
        raise
    except mp.ProcessRaisedException as err:
        text = str(err).strip()
        detail = text if os.environ.get("BRIDGE_DEBUG") == "1" else text.splitlines()[-1]
        raise BridgeError(f"a rank failed: {detail}") from None
    except mp.ProcessExitedException as err:
        raise BridgeError(f"a rank died: {err}") from None


def _stop(context: Any) -> None:
    """Terminate and reap every rank, and remove the error files torch made for them."""
    for process in context.processes:
        if process.is_alive():
            process.terminate()
    for process in context.processes:
        process.join()
    for path in getattr(context, "error_files", []):
        if path and os.path.exists(path):
            os.unlink(path)


def _rank_main(rank: int, size: int, port: int, layout: Layout | None, fn: Callable[..., None], args: tuple) -> None:
    import torch.distributed as dist

    from hf_mcore_bridge.megatron_cpu import apply_cpu_workarounds, apply_te_absent_workarounds
    from hf_mcore_bridge.quiet import quiet_libraries

    quiet_libraries()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    if layout is None:
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
        return
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
