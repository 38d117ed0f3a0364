"""Policy + optimizer checkpoints of a DTensor GRPO run, written atomically, each with an HF copy of the policy.

Layout, beside Megatron-LM's tracker so that `grpo.backends.megatron.checkpoint.latest_step`, resume and `bridge export`
find checkpoints of either backend the same way:

    <root>/latest_checkpointed_iteration.txt    the newest complete step
    <root>/iter_0000010/model_optim/            torch.distributed.checkpoint of `get_state_dict(model, optimizer)`
    <root>/iter_0000010/trainer_state.json      step, prompt iterator position, LR scheduler, optimizer steps
    <root>/iter_0000010/hf/                     the policy as an HF directory: model.safetensors (full tensors in
                                                the policy dtype), config.json, tokenizer.json

A LoRA run's checkpoint (`policy.lora`) holds its adapters instead of the whole policy; its base weights are not
stored again (they are `policy.model_path`'s, frozen, and a resumed run reads them from there):

    <root>/iter_0000010/model_optim/            DCP of the adapters alone (`ignore_frozen_params`) and of their
                                                optimizer state (the optimizer holds nothing else)
    <root>/iter_0000010/trainer_state.json      as above
    <root>/iter_0000010/adapter/                the adapters gathered whole as a PEFT directory
                                                (`adapter_config.json`: rank, alpha, targets, and the absolute
                                                `policy.model_path` as `base_model_name_or_path`)
    <root>/iter_0000010/hf/                     config.json and tokenizer.json of the base (no weights)

`bridge export` merges the adapters into the base read from `base_model_name_or_path`, or copies them (`--peft`).
Reading these directories without a process group (export, inspect, the resume check) is `checkpoint_dirs`'.

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
from hf_mcore_bridge.grpo.backends.dtensor.checkpoint_dirs import (
    ADAPTER_DIR,
    HF_DIR,
    MODEL_OPTIM_DIR,
    SAFETENSORS_NAME,
    TRAINER_STATE,
)

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.backends.dtensor.policy import DTensorPolicy

__all__ = ["ADAPTER_DIR", "HF_DIR", "MODEL_OPTIM_DIR", "load_dtensor_checkpoint", "save_dtensor_checkpoint"]


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
    policy: DTensorPolicy,
    root: Path,
    step: int,
    trainer_state: dict[str, Any],
    assets: dict[str, str],
    base_model: str | None = None,
) -> Path:
    """Write model, optimizer, `trainer_state` and the HF copy for `step` (collective: every rank calls it); with
    LoRA the adapters and their optimizer state, the adapters as a PEFT directory naming `base_model` (the run's
    `policy.model_path`) and the HF assets without weights.

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
    model_state, optim_state = get_state_dict(policy.model, policy.optimizer, options=_options(policy))
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=staging / MODEL_OPTIM_DIR)
    if policy.lora is None:
        _write_hf(policy, staging / HF_DIR, assets, rank0)
    else:
        _write_adapter(policy, staging, assets, base_model, rank0)
    if rank0:
        state = {**trainer_state, "step": step, "scheduler": policy.scheduler.state_dict()}
        (staging / TRAINER_STATE).write_text(json.dumps(state, indent=2))
    dist.barrier()
    if rank0:
        publish_iteration(staging, final, root, step)
    dist.barrier()
    return final


def _options(policy: DTensorPolicy) -> Any:
    """DCP's state-dict options: with LoRA the frozen base is left out (it is `policy.model_path`'s)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=policy.lora is not None, strict=policy.lora is None)


def _write_adapter(
    policy: DTensorPolicy, staging: Path, assets: dict[str, str], base_model: str | None, rank0: bool
) -> None:
    """A LoRA checkpoint's PEFT directory (gathered: every rank takes part) and its base's HF assets (rank 0)."""
    from hf_mcore_bridge.grpo.backends.dtensor.lora import full_adapters
    from hf_mcore_bridge.megatron.lora_peft import write_peft_adapter

    assert policy.lora is not None
    values = {name: (a.cpu(), b.cpu()) for name, (a, b) in full_adapters(policy.model)}
    if rank0:
        base = str(Path(base_model).resolve()) if base_model is not None else None
        write_peft_adapter(values, policy.lora, staging / ADAPTER_DIR, base)
        for name, text in assets.items():
            (staging / HF_DIR / name).write_text(text)


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
    """Restore model, optimizer and scheduler from `root`'s checkpoint of `step`; returns the trainer state. With
    LoRA the adapters and their optimizer state (the base stays as built from `policy.model_path`); CheckpointError
    when a parameter the optimizer trains is not in the checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from hf_mcore_bridge.errors import CheckpointError

    directory = root / iteration_dirname(step)
    options = _options(policy)
    model_state, optim_state = get_state_dict(policy.model, policy.optimizer, options=options)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, storage_reader=_AllowListReader(directory / MODEL_OPTIM_DIR))
    keys = set_state_dict(
        policy.model,
        policy.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=options,
    )
    trained = {name for name, p in policy.model.named_parameters() if p.requires_grad}
    missing = sorted(trained & set(keys.missing_keys)) + sorted(keys.unexpected_keys)
    if missing:
        raise CheckpointError(f"{directory}: {missing[0]} does not match the model's trained parameters")
    trainer = json.loads((directory / TRAINER_STATE).read_text())
    policy.scheduler.load_state_dict(trainer["scheduler"])
    policy.optimizer_steps = int(trainer["optimizer_steps"])
    return trainer
