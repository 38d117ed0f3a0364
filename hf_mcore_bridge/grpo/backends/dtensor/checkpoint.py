"""Policy + optimizer checkpoints of a DTensor GRPO run, written atomically, each with an HF copy of the policy.

Layout, beside Megatron-LM's tracker so that `grpo.backends.megatron.checkpoint.latest_step`, resume and `bridge export`
find checkpoints of either backend the same way:

    <root>/latest_checkpointed_iteration.txt    the newest complete step
    <root>/iter_0000010/model_optim/            torch.distributed.checkpoint of `get_state_dict(model, optimizer)`
    <root>/iter_0000010/trainer_state.json      step, prompt iterator position, LR scheduler, optimizer steps
    <root>/iter_0000010/hf/                     the policy as an HF directory: model.safetensors (full tensors in
                                                the policy dtype), config.json, tokenizer.json

A checkpoint is written into a hidden `.iter_XXXXXXX.partial` sibling, renamed into place by rank 0 once every
rank has finished, and only then does the tracker point at it. The HF weights are streamed by rank 0 tensor by
tensor as the ranks gather them (`SafetensorsStreamWriter`), so no rank holds the whole model at once.

Loading never unpickles beyond data: DCP's `.metadata` pickle is read with the allow-listed unpickler of
`dcp_reader`, its data items with `torch.load(weights_only=True)` (DCP's own reader), the trainer state is JSON.
Simplifications: saving is synchronous; old checkpoints are not pruned; the HF copy is one safetensors file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader

from hf_mcore_bridge.checkpoint.megatron_dirs import iteration_dirname, publish_iteration

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.inspect import Inspection
    from hf_mcore_bridge.grpo.backends.dtensor.policy import DTensorPolicy

__all__ = ["HF_DIR", "hf_policy_of", "inspection_of", "load_dtensor_checkpoint", "save_dtensor_checkpoint"]

HF_DIR = "hf"
"""The checkpoint's HF copy of the policy."""
MODEL_OPTIM_DIR = "model_optim"
TRAINER_STATE = "trainer_state.json"
SAFETENSORS_NAME = "model.safetensors"


def hf_policy_of(checkpoint_dir: Path) -> Path | None:
    """The HF copy inside a DTensor checkpoint directory (`iter_XXXXXXX`), or None for other checkpoints."""
    hf = checkpoint_dir / HF_DIR
    return hf if (hf / SAFETENSORS_NAME).is_file() else None


def inspection_of(path: Path) -> Inspection | None:
    """`bridge inspect` of a DTensor checkpoint (its root or an `iter_XXXXXXX`): the tensors of its HF copy of the
    policy, reported as the checkpoint's; None for any other directory."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import resolve_checkpoint
    from hf_mcore_bridge.convert.inspect import inspect_path
    from hf_mcore_bridge.errors import BridgeError

    try:
        _, checkpoint_dir = resolve_checkpoint(path)
    except BridgeError:
        return None
    hf = hf_policy_of(checkpoint_dir)
    if hf is None:
        return None
    report = inspect_path(hf)
    name = checkpoint_dir.name
    step = f"step {int(name[5:])}" if name.startswith("iter_") and name[5:].isdigit() else name
    report.path = str(checkpoint_dir)
    report.format = f"DTensor GRPO checkpoint ({step}); the tensors of its HF copy, {HF_DIR}/"
    return report


class _AllowListReader(FileSystemReader):
    """DCP's file reader with `.metadata` unpickled through an allow-list instead of plain `pickle.load`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        from hf_mcore_bridge.checkpoint.dcp_reader import read_metadata

        metadata = read_metadata(Path(str(self.path)))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def save_dtensor_checkpoint(
    policy: DTensorPolicy, root: Path, step: int, trainer_state: dict[str, Any], assets: dict[str, str]
) -> Path:
    """Write model, optimizer, `trainer_state` and the HF copy for `step` (collective: every rank calls it).

    `assets` maps HF asset file names (`config.json`, `tokenizer.json`) to their text.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    final = root / iteration_dirname(step)
    staging = root / f".{final.name}.partial"
    rank0 = dist.get_rank() == 0
    if rank0:
        shutil.rmtree(staging, ignore_errors=True)
        (staging / HF_DIR).mkdir(parents=True)
    dist.barrier()
    model_state, optim_state = get_state_dict(policy.model, policy.optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging / MODEL_OPTIM_DIR)
    _write_hf(policy, staging / HF_DIR, assets, rank0)
    if rank0:
        state = {**trainer_state, "step": step, "scheduler": policy.scheduler.state_dict()}
        (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    dist.barrier()
    if rank0:
        publish_iteration(staging, final, root, step)
    dist.barrier()
    return final


def _write_hf(policy: DTensorPolicy, directory: Path, assets: dict[str, str], rank0: bool) -> None:
    """Stream the full tensors into `directory/model.safetensors` on rank 0 (every rank takes part in gathers)."""
    from hf_mcore_bridge.checkpoint import dtypes
    from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsStreamWriter

    writer = SafetensorsStreamWriter(directory / SAFETENSORS_NAME, policy.hf_specs()) if rank0 else None
    try:
        for name, tensor in policy.hf_weights():
            if writer is not None:
                writer.write(name, tensor)
    finally:
        if writer is not None:
            writer.close()
    if rank0:
        for name, text in assets.items():
            if name == "config.json":
                text = json.dumps({**json.loads(text), "torch_dtype": dtypes.of(policy.dtype).name}, indent=2)
            (directory / name).write_text(text)


def load_dtensor_checkpoint(policy: DTensorPolicy, root: Path, step: int) -> dict[str, Any]:
    """Restore model, optimizer and scheduler from `root`'s checkpoint of `step`; returns the trainer state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    directory = root / iteration_dirname(step)
    model_state, optim_state = get_state_dict(policy.model, policy.optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, storage_reader=_AllowListReader(directory / MODEL_OPTIM_DIR))
    set_state_dict(policy.model, policy.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    trainer = json.loads((directory / TRAINER_STATE).read_text())
    policy.scheduler.load_state_dict(trainer["scheduler"])
    policy.optimizer_steps = int(trainer["optimizer_steps"])
    return trainer
