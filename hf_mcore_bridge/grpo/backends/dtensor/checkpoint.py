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
from hf_mcore_bridge.megatron.lora_config import LoraConfig

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.inspect import Inspection
    from hf_mcore_bridge.grpo.backends.dtensor.policy import DTensorPolicy

__all__ = [
    "ADAPTER_DIR",
    "HF_DIR",
    "adapter_base",
    "adapter_lora",
    "adapter_of",
    "conversion_refusal",
    "hf_policy_of",
    "inspection_of",
    "load_dtensor_checkpoint",
    "save_dtensor_checkpoint",
]

HF_DIR = "hf"
"""The checkpoint's HF copy of the policy."""
ADAPTER_DIR = "adapter"
"""A LoRA run's checkpoint's adapters, a PEFT directory."""
MODEL_OPTIM_DIR = "model_optim"
TRAINER_STATE = "trainer_state.json"
SAFETENSORS_NAME = "model.safetensors"


def hf_policy_of(checkpoint_dir: Path) -> Path | None:
    """The HF copy inside a DTensor checkpoint directory (`iter_XXXXXXX`), or None for other checkpoints."""
    hf = checkpoint_dir / HF_DIR
    return hf if (hf / SAFETENSORS_NAME).is_file() else None


def adapter_of(checkpoint_dir: Path) -> Path | None:
    """The PEFT directory of a LoRA run's DTensor checkpoint (`iter_XXXXXXX`), or None for other checkpoints."""
    adapter = checkpoint_dir / ADAPTER_DIR
    return (
        adapter if (adapter / "adapter_config.json").is_file() and (checkpoint_dir / MODEL_OPTIM_DIR).is_dir() else None
    )


def adapter_lora(checkpoint_dir: Path) -> LoraConfig | None:
    """The rank, alpha and targets of a DTensor checkpoint's adapters (its `adapter_config.json`, read as JSON);
    None for a checkpoint without adapters."""
    adapter = adapter_of(checkpoint_dir)
    if adapter is None:
        return None
    saved = json.loads((adapter / "adapter_config.json").read_text())
    targets = saved["target_modules"]
    targets = tuple(sorted(targets if isinstance(targets, list) else [targets]))
    return LoraConfig(enabled=True, rank=int(saved["r"]), alpha=float(saved["lora_alpha"]), target_modules=targets)


def adapter_base(checkpoint_dir: Path) -> str | None:
    """The base model a DTensor LoRA checkpoint's adapters name (the run's `policy.model_path`, absolute)."""
    adapter = adapter_of(checkpoint_dir)
    if adapter is None:
        return None
    return json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")


def inspection_of(path: Path) -> Inspection | None:
    """`bridge inspect` of a DTensor checkpoint (its root or an `iter_XXXXXXX`): the tensors of its HF copy of the
    policy, or of a LoRA run's adapters, reported as the checkpoint's; None for any other directory."""
    from hf_mcore_bridge.convert.inspect import inspect_path

    checkpoint_dir = _dtensor_checkpoint(path)
    if checkpoint_dir is None:
        return None
    name = checkpoint_dir.name
    step = f"step {int(name[5:])}" if name.startswith("iter_") and name[5:].isdigit() else name
    hf = hf_policy_of(checkpoint_dir)
    if hf is not None:
        report = inspect_path(hf)
        report.format = f"DTensor GRPO checkpoint ({step}); the tensors of its HF copy, {HF_DIR}/"
    else:
        report = _inspect_adapter(checkpoint_dir)
        report.format = f"DTensor GRPO LoRA checkpoint ({step}); its adapters, {ADAPTER_DIR}/ (no base weights)"
    report.path = str(checkpoint_dir)
    return report


def _dtensor_checkpoint(path: Path) -> Path | None:
    """The iteration directory of a DTensor checkpoint (full or LoRA) at `path` (root or iteration); else None."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import resolve_checkpoint
    from hf_mcore_bridge.errors import BridgeError

    try:
        _, checkpoint_dir = resolve_checkpoint(path)
    except BridgeError:
        return None
    if hf_policy_of(checkpoint_dir) is None and adapter_of(checkpoint_dir) is None:
        return None
    return checkpoint_dir


def _inspect_adapter(checkpoint_dir: Path) -> Inspection:
    """The adapter tensors of a LoRA checkpoint (small: read whole), the base's architecture."""
    from safetensors.torch import load_file

    from hf_mcore_bridge.convert.inspect import Inspection, TensorRow

    tensors = load_file(str(checkpoint_dir / ADAPTER_DIR / "adapter_model.safetensors"))
    rows = [
        TensorRow(name, list(t.shape), str(t.dtype).removeprefix("torch."), t.numel() * t.element_size())
        for name, t in sorted(tensors.items())
    ]
    config = json.loads((checkpoint_dir / HF_DIR / "config.json").read_text())
    return Inspection(
        path=str(checkpoint_dir),
        format="",
        architecture=(config.get("architectures") or [None])[0],
        layout={},
        dtypes=sorted({r.dtype for r in rows}),
        parameters=sum(t.numel() for t in tensors.values()),
        total_bytes=sum(r.bytes for r in rows),
        tensors=rows,
        notes=[f"the base weights are {adapter_base(checkpoint_dir)}'s (policy.model_path), not stored here"],
    )


def conversion_refusal(path: Path, iteration: int | None = None) -> str | None:
    """Why `bridge convert --to hf` does not read `path`: a DTensor run's checkpoint, which `bridge export` writes
    as HF (None for any other directory)."""
    from hf_mcore_bridge.checkpoint.megatron_dirs import resolve_checkpoint
    from hf_mcore_bridge.errors import BridgeError

    try:
        _, checkpoint_dir = resolve_checkpoint(path, iteration)
    except BridgeError:
        return None
    if adapter_of(checkpoint_dir) is not None:
        return (
            f"{checkpoint_dir} is a DTensor LoRA run's checkpoint (its adapters, no base weights): `bridge export RUN"
            " DEST` writes its merged weights, `bridge export --peft` its adapters"
        )
    if hf_policy_of(checkpoint_dir) is not None:
        return f"{checkpoint_dir} is a DTensor run's checkpoint: `bridge export RUN DEST` writes its HF policy"
    return None


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
