"""What a DTensor GRPO checkpoint directory holds, read without torch.distributed: its HF copy of the policy, or a
LoRA run's adapters (a PEFT directory naming their base); for `bridge export`, `bridge inspect`, `bridge convert`'s
refusal and the resume check. The layout is `grpo.backends.dtensor.checkpoint`'s, which writes it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from hf_mcore_bridge.megatron.lora_config import LoraConfig, peft_targets

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.inspect import Inspection

__all__ = [
    "ADAPTER_DIR",
    "HF_DIR",
    "MODEL_OPTIM_DIR",
    "adapter_base",
    "adapter_lora",
    "adapter_of",
    "conversion_refusal",
    "hf_policy_of",
    "inspection_of",
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
    """The rank, alpha and targets of a DTensor checkpoint's adapters (its `adapter_config.json`, read as JSON: its
    `target_modules` and the experts' `target_parameters`); None for a checkpoint without adapters."""
    adapter = adapter_of(checkpoint_dir)
    if adapter is None:
        return None
    saved = json.loads((adapter / "adapter_config.json").read_text())
    targets = tuple(sorted(peft_targets(saved)))
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
