"""How a GRPO run starts, resumes and stops, around the loop of `grpo.run.trainer`.

Starting: spawned locally (`world.run_world`), the launcher process validates the config and prepares the run
(converts an HF policy, trims the metrics of steps about to be rerun, saves the resolved config) before any rank
exists. Under an env:// launcher (`torchrun`, possibly over several nodes) every process is a rank: each checks
that the launcher started the world the config lays out, joins it, and global rank 0 alone prepares the run while
the others wait (`prepare_once`; on a gloo group with a long timeout, as converting a large model may outlast
NCCL's default timeout), then receives what it prepared. Rank 0 writes into `logger.log_dir` and the ranks read
from it, and all ranks write checkpoints into `checkpointing.checkpoint_dir`: both must be storage every node
sees at the same path, which `check_shared_storage` verifies at start (one line naming the ranks that do not).

Resuming: `check_resumable` refuses, in one line naming both, a checkpoint directory that holds another model
(architecture or shape), the other backend's checkpoints, or another `policy.lora` (adapters or none, rank, alpha,
targets), before any rank starts.

Stopping: `stopped_message` is the one line printed when SIGINT / SIGTERM stopped the spawned ranks
(`world.RunStopped`): the steps done and the last checkpoint (read from the checkpoint tracker), after removing the
interrupted save's staging directory, if any.
"""

from __future__ import annotations

import dataclasses
import secrets
import shutil
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

from hf_mcore_bridge.checkpoint.megatron_dirs import iteration_dirname
from hf_mcore_bridge.errors import BridgeError, RunStopped
from hf_mcore_bridge.grpo.errors import GRPOConfigError
from hf_mcore_bridge.grpo.run.config import GRPOConfig
from hf_mcore_bridge.grpo.run.plan import ParallelDims
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = ["check_resumable", "check_shared_storage", "check_start", "prepare_once", "stopped_message"]

PREPARE_TIMEOUT = timedelta(hours=6)
"""How long the other ranks wait for rank 0 to prepare the run (an HF -> Megatron conversion of a large model)."""

SHARED_PATIENCE_S = 60.0
"""How long a rank looks for rank 0's file before calling a directory unshared (NFS caches directory listings for
up to 30 s by default)."""

T = TypeVar("T")


def check_start(config: GRPOConfig, dims: ParallelDims) -> None:
    """Refuse a world the run cannot start in: a launcher's world of another size than the run's (`dims.world`),
    or `cluster.num_nodes > 1` without a launcher."""
    from hf_mcore_bridge.megatron.world import check_launched_size, launched_world

    cluster = config.cluster
    if cluster.gpus_per_node is not None:
        what = f"cluster.gpus_per_node x cluster.num_nodes ({cluster.gpus_per_node} x {cluster.num_nodes})"
    else:
        what = "the config's layout (tensor x pipeline x context x expert parallel sizes; set cluster.gpus_per_node)"
    check_launched_size(dims.world, what)
    if launched_world() is None and cluster.num_nodes > 1:
        raise GRPOConfigError(
            f"cluster.num_nodes={cluster.num_nodes}: a multi-node run is started by a launcher on every node"
            " (torchrun --nnodes ..., see docs/scale-out.md), not spawned from one"
        )


def prepare_once(prepare: Callable[[], T]) -> T:
    """Under a launcher: `prepare()` on global rank 0 while the others wait; every rank returns its result. A
    `BridgeError` there is raised on every rank: rank 0's own, reported by rank 0; on the others a silent
    `WorldError` saying where it came from (`world.fail_alike`)."""
    import torch.distributed as dist

    from hf_mcore_bridge.megatron.world import fail_alike

    group = dist.new_group(backend="gloo", timeout=PREPARE_TIMEOUT)
    try:
        outcome: Any = None
        if dist.get_rank() == 0:
            try:
                outcome = prepare()
            except BridgeError as err:
                outcome = err
        holder = [outcome]
        dist.broadcast_object_list(holder, src=0, group=group)
    finally:
        dist.destroy_process_group(group)
    outcome = holder[0]
    if isinstance(outcome, BridgeError):
        if dist.get_rank() == 0:
            raise outcome
        fail_alike(f"rank 0 could not prepare the run: {outcome}")  # rank 0 reports its own error
    return outcome


def check_shared_storage(directories: dict[str, Path], patience_s: float = SHARED_PATIENCE_S) -> None:
    """Collective: raise `BridgeError` on every rank unless each rank sees the file rank 0 writes into each of
    `directories` (named by their config keys) within `patience_s` — i.e. unless they are shared storage at the
    same path."""
    import socket
    import time

    import torch.distributed as dist

    rank = dist.get_rank()
    token = secrets.token_hex(8) if rank == 0 else None
    if rank == 0:
        for directory in directories.values():
            directory.mkdir(parents=True, exist_ok=True)
            (directory / f".bridge-shared-{token}").write_text(str(token))
    holder = [token]
    dist.broadcast_object_list(holder, src=0)
    token = holder[0]
    deadline = time.monotonic() + patience_s
    while True:  # network file systems may cache a directory's listing for a while
        unseen = [
            key
            for key, directory in directories.items()
            if not _reads(directory / f".bridge-shared-{token}", str(token))
        ]
        if not unseen or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    seen_by: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(seen_by, (rank, socket.gethostname(), unseen))
    if rank == 0:
        for directory in directories.values():
            (directory / f".bridge-shared-{token}").unlink(missing_ok=True)
    blind = [(r, host, keys) for r, host, keys in seen_by if keys]
    if blind:
        keys = sorted({key for _, _, ks in blind for key in ks})
        where = ", ".join(f"rank {r} on {host}" for r, host, _ in blind)
        raise BridgeError(
            f"{' and '.join(f'{k}={directories[k]}' for k in keys)} is not shared storage: {where} cannot see the"
            " file rank 0 wrote there; a run over several nodes needs it on storage every node mounts at the same"
            " path"
        )


def _reads(path: Path, text: str) -> bool:
    try:
        return path.read_text() == text
    except OSError:
        return False


def _describe(model: ModelSpec) -> str:
    return (
        f"{model.architecture} ({model.num_layers} layers, hidden {model.hidden_size}, FFN {model.ffn_hidden_size},"
        f" {model.num_attention_heads} heads / {model.num_query_groups} KV groups, vocab {model.vocab_size}"
        + (f", {model.moe.num_experts} experts" if model.moe else "")
        + ")"
    )


def _model_of(path: Path) -> ModelSpec:
    """The model an HF directory (its `config.json`) or a Megatron checkpoint (its `args`) holds; nothing loaded."""
    import json

    from hf_mcore_bridge.checkpoint.megatron_dirs import read_common, resolve_checkpoint
    from hf_mcore_bridge.convert import config_bridge

    if (path / "config.json").is_file():
        hf_config = json.loads((path / "config.json").read_text())
        return config_bridge.megatron_spec(hf_config)
    _, checkpoint_dir = resolve_checkpoint(path)
    return config_bridge.from_megatron_args(read_common(checkpoint_dir)["args"])


def check_resumable(config: GRPOConfig, step: int) -> None:
    """Raise `GRPOConfigError` unless `checkpointing.checkpoint_dir`'s checkpoint of `step` was written by this
    backend for the model of `policy.model_path` (the dtype may differ). Reads configs only: run it before the
    policy is converted."""
    from hf_mcore_bridge.grpo.backends.dtensor.checkpoint_dirs import HF_DIR, MODEL_OPTIM_DIR

    root = Path(config.checkpointing.checkpoint_dir)
    directory = root / iteration_dirname(step)
    saved_dtensor = (directory / MODEL_OPTIM_DIR).is_dir()
    dtensor = config.policy.dtensor_cfg.enabled
    backend = {True: "DTensor", False: "megatron-core"}
    if saved_dtensor != dtensor:
        raise GRPOConfigError(
            f"checkpointing.checkpoint_dir={root} holds {backend[saved_dtensor]} checkpoints (step {step}) but this"
            f" run trains with the {backend[dtensor]} backend: give the run a new checkpointing.checkpoint_dir"
        )
    _check_lora(config, directory, saved_dtensor)
    saved = _model_of(directory / HF_DIR if saved_dtensor else directory)
    model = _model_of(Path(config.policy.model_path))
    ignored = {"torch_dtype"}
    if {k: v for k, v in dataclasses.asdict(saved).items() if k not in ignored} != {
        k: v for k, v in dataclasses.asdict(model).items() if k not in ignored
    }:
        raise GRPOConfigError(
            f"cannot resume: checkpointing.checkpoint_dir={root} (step {step}) holds {_describe(saved)} but"
            f" policy.model_path={config.policy.model_path} is {_describe(model)}; give a new"
            " checkpointing.checkpoint_dir to train this model"
        )


def _check_lora(config: GRPOConfig, directory: Path, dtensor: bool) -> None:
    """A checkpoint resumes only with the `policy.lora` it was written with (adapters or none; rank, alpha and
    targets): its tensors and optimizer state are those adapters'. A megatron checkpoint keeps it in its common
    state, a DTensor checkpoint in its PEFT directory's `adapter_config.json`."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import read_common
    from hf_mcore_bridge.grpo.backends.dtensor.checkpoint_dirs import adapter_lora
    from hf_mcore_bridge.megatron.lora_checkpoint import lora_of_common

    saved = adapter_lora(directory) if dtensor else lora_of_common(read_common(directory))
    lora = config.policy.lora if config.policy.lora.enabled else None

    def describe(value: Any) -> str:
        if value is None:
            return "no LoRA adapters (full training)"
        return f"LoRA rank {value.rank}, alpha {value.alpha:g}, target_modules {sorted(value.target_modules)}"

    if describe(saved) != describe(lora):
        raise GRPOConfigError(
            f"cannot resume: checkpointing.checkpoint_dir={directory.parent} ({directory.name}) holds {describe(saved)}"
            f" but policy.lora asks for {describe(lora)}; set policy.lora as it was or give a new"
            " checkpointing.checkpoint_dir"
        )


def stopped_message(config: GRPOConfig, log_dir: Path, stopped: RunStopped) -> str:
    """The line printed after a signal stopped the ranks: steps done and the last checkpoint saved, if any."""
    from hf_mcore_bridge.grpo.backends.megatron.checkpoint import latest_step
    from hf_mcore_bridge.grpo.run.metrics import read_metrics

    done = max((int(m["step"]) for m in read_metrics(log_dir)), default=0)
    head = f"stopped by {stopped.signal_name} after step {done} of {config.grpo.max_num_steps}"
    ckpt = config.checkpointing
    if not ckpt.enabled:
        return f"{head}; no checkpoint was saved (checkpointing.enabled is false)"
    root = Path(ckpt.checkpoint_dir)
    for staging in root.glob(".iter_*.partial"):  # the save the signal interrupted: never published
        shutil.rmtree(staging, ignore_errors=True)
    step = latest_step(root)
    if step is None:
        return f"{head}; no checkpoint was saved yet (checkpointing.save_period={ckpt.save_period})"
    return f"{head}; last checkpoint: step {step} in {root / iteration_dirname(step)}; the same command resumes from it"
