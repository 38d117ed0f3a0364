"""Policy + optimizer checkpoints of a GRPO run, as megatron-core distributed checkpoints, written atomically.

Layout as Megatron-LM: `<root>/iter_0000010/` (a `torch_dist` checkpoint of `{"model", "optimizer"}` sharded state;
`common.pt` carries Megatron-LM `args`, `iteration` and the trainer's plain state), `<root>/hf_assets/` (the HF
config and tokenizer) and `<root>/latest_checkpointed_iteration.txt`. So a checkpoint is also a policy
`model_path` and exports to HF with `convert_mcore_to_hf` like any Megatron checkpoint. A checkpoint is
written into a hidden `.iter_XXXXXXX.partial` sibling, renamed into place by rank 0 once every rank has finished,
and only then does the tracker point at it: an interrupted save leaves the previous checkpoint current.

The trainer state (`trainer` in `common.pt`): the step, the prompt iterator's position, the LR scheduler's state
and the optimizer step count; sampling seeds are derived from the step, so a resumed run repeats an uninterrupted
one. The KL reference is the run's initial policy, reloaded from its original checkpoint on resume, not saved.

A LoRA run's checkpoint holds the frozen base weights, the adapters beside their linears (`megatron.lora`) and the
optimizer's state of the adapters alone (the only parameters it holds); its `policy.lora` is kept in the common
state (`megatron.lora_checkpoint.LORA_KEY`), for the resume check and `bridge export`.

Simplifications: saving is synchronous; old checkpoints are not pruned.

megatron-core's `torch_dist` writer passes its results through a `multiprocessing` manager, a server process each
rank starts at its first save and keeps. Left to megatron-core, that process outlives a rank killed with its
launcher; `_write_results_queue` starts it (once per rank) so that the kernel ends it with its rank.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint.megatron_dirs import (
    CHECKPOINT_VERSION,
    HF_ASSETS_DIR,
    TRACKER_NAME,
    iteration_dirname,
    publish_iteration,
)
from hf_mcore_bridge.grpo.backends.megatron.policy import Policy
from hf_mcore_bridge.megatron.lora_checkpoint import LORA_KEY, lora_state
from hf_mcore_bridge.megatron.lora_config import LoraConfig

__all__ = ["latest_step", "load_checkpoint", "save_checkpoint"]


def _sharded_state(policy: Policy, is_loading: bool) -> dict[str, Any]:
    model_state = policy.module.sharded_state_dict()
    return {"model": model_state, "optimizer": policy.optimizer.sharded_state_dict(model_state, is_loading=is_loading)}


def latest_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint under `root`, or None."""
    tracker = root / TRACKER_NAME
    if not tracker.is_file():
        return None
    text = tracker.read_text().strip()
    return int(text) if text.isdigit() else None


def save_checkpoint(
    policy: Policy,
    root: Path,
    step: int,
    trainer_state: dict[str, Any],
    args: argparse.Namespace,
    assets: dict[str, str],
    lora: LoraConfig | None = None,
) -> Path:
    """Write policy, optimizer and `trainer_state` for `step` (collective: every rank calls it).

    `args` is the Megatron-LM namespace describing the model; `assets` maps HF asset file names (`config.json`,
    `tokenizer.json`) to their text, written once under `<root>/hf_assets/`; `lora`: the run's adapters' config.
    """
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    final = root / iteration_dirname(step)
    staging = root / f".{final.name}.partial"
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        _write_assets(root / HF_ASSETS_DIR, assets)
    dist.barrier()
    state = _sharded_state(policy, is_loading=False)
    state["trainer"] = {**trainer_state, "step": step, "scheduler": policy.scheduler.state_dict()}
    state.update(args=args, checkpoint_version=CHECKPOINT_VERSION, iteration=step)
    if lora is not None:
        state[LORA_KEY] = lora_state(lora)
    _write_results_queue()
    dist_checkpointing.save(state, str(staging))
    dist.barrier()
    if dist.get_rank() == 0:
        publish_iteration(staging, final, root, step)
    dist.barrier()
    return final


def _write_results_queue() -> None:
    """Put a queue served by a manager process that dies with this rank where megatron-core's writer looks for
    its results queue (megatron-core creates one on first use, without that, and reuses whichever is there)."""
    import multiprocessing
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from hf_mcore_bridge.megatron.process_death import die_with_parent

    if getattr(filesystem_async, "_results_queue", False) is None:
        manager = SyncManager(ctx=multiprocessing.get_context("spawn"))
        manager.start(die_with_parent)
        filesystem_async._results_queue = manager.Queue()


def _write_assets(directory: Path, assets: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in assets.items():
        if not (directory / name).exists():
            (directory / name).write_text(text)


def load_checkpoint(policy: Policy, root: Path, step: int) -> dict[str, Any]:
    """Restore policy, optimizer and scheduler from `root`'s checkpoint of `step`; returns the trainer state."""
    from megatron.core import dist_checkpointing

    state = dist_checkpointing.load(_sharded_state(policy, is_loading=True), str(root / iteration_dirname(step)))
    policy.module.load_state_dict(state["model"])
    policy.optimizer.load_state_dict(state["optimizer"])
    trainer = state["trainer"]
    policy.scheduler.load_state_dict(trainer["scheduler"])
    policy.optimizer_steps = int(trainer["optimizer_steps"])
    return trainer
