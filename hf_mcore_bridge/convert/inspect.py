"""`bridge inspect`: what an HF directory or a Megatron checkpoint holds, for people (a table) and machines (JSON).

Reads every format the tool writes: HF safetensors, megatron-core `torch_dist` (tensor metadata only; in the
Megatron-Bridge layout the model and its layout are read from `run_config.yaml`, the architecture from the HF
assets) and the legacy per-rank `torch` files (each rank's file opened weights-only, memory-mapped). Legacy
tensors are reported in the distributed checkpoint's stacked, global form, so both Megatron formats of one model
read the same; that needs the architecture recorded in `args.hf_architecture` (this tool records it) to know how
tensors were split over TP ranks. Without it the shapes are those of tensor-parallel rank 0, and a note says so.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint
from hf_mcore_bridge.checkpoint.megatron_dirs import hf_assets_dir, read_common, resolve_checkpoint, safe_torch_load
from hf_mcore_bridge.convert.bridge_layout import args_from_run_config, is_bridge_checkpoint, read_run_config
from hf_mcore_bridge.errors import CheckpointError


@dataclass
class TensorRow:
    name: str
    shape: list[int]
    dtype: str
    bytes: int


@dataclass
class Inspection:
    """A summary of a checkpoint."""

    path: str
    format: str
    architecture: str | None
    layout: dict[str, Any]
    dtypes: list[str]
    parameters: int
    total_bytes: int
    tensors: list[TensorRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def inspect_path(path: Path | str) -> Inspection:
    """Inspect an HF model directory or a Megatron (`torch_dist`) checkpoint."""
    path = Path(path)
    if (path / "config.json").exists() and not (path / "latest_checkpointed_iteration.txt").exists():
        return _inspect_hf(path)
    return _inspect_mcore(path)


def _row(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> TensorRow:
    return TensorRow(name, list(shape), str(dtype).removeprefix("torch."), _numel(shape) * dtype.itemsize)


def _inspect_hf(path: Path) -> Inspection:
    from hf_mcore_bridge.convert.fp8_checkpoint import SCALE_SUFFIX, is_fp8_config

    hf = HFCheckpoint(path)
    rows = [_row(name, hf.info(name).shape, hf.info(name).dtype) for name in sorted(hf.names())]
    notes = []
    if is_fp8_config(hf.config):
        scales = sum(r.name.endswith(SCALE_SUFFIX) for r in rows)
        notes.append(
            f"{scales} weights in 128 x 128 FP8 blocks (float8_e4m3fn with {SCALE_SUFFIX}; the parameter count "
            "includes the scales); conversion dequantizes them to bfloat16"
        )
    return Inspection(
        path=str(path),
        format="huggingface safetensors",
        architecture=hf.architecture,
        layout={},
        dtypes=sorted({r.dtype for r in rows}),
        parameters=sum(_numel(tuple(r.shape)) for r in rows),
        total_bytes=sum(r.bytes for r in rows),
        tensors=rows,
        notes=notes,
    )


def _inspect_mcore(path: Path) -> Inspection:
    root, checkpoint_dir = resolve_checkpoint(path)
    if not (checkpoint_dir / ".metadata").exists() and any(checkpoint_dir.glob("mp_rank_*")):
        return _inspect_legacy(checkpoint_dir)
    common = read_common(checkpoint_dir)
    args, fmt = common.get("args"), "torch_dist"
    if args is None and is_bridge_checkpoint(checkpoint_dir):  # Megatron-Bridge keeps the model in run_config.yaml
        args, fmt = args_from_run_config(read_run_config(checkpoint_dir)), "torch_dist, Megatron-Bridge layout"
    dcp = DCPCheckpoint(checkpoint_dir)
    rows = [_row(key, dcp.tensor_meta(key).shape, dcp.tensor_meta(key).dtype) for key in sorted(dcp.tensor_keys())]
    inspection = _megatron_inspection(checkpoint_dir, fmt, common.get("iteration", "?"), args, rows, [])
    if inspection.architecture is None:  # args without it (a Megatron-Bridge save): the HF assets name it
        inspection.architecture = _assets_architecture(root, checkpoint_dir)
    return inspection


def _assets_architecture(root: Path, checkpoint_dir: Path) -> str | None:
    """The `architectures` entry of the HF config kept beside a checkpoint (`hf_assets/`), if any."""
    assets = hf_assets_dir(root, checkpoint_dir)
    if assets is None:
        return None
    try:
        architectures = json.loads((assets / "config.json").read_text()).get("architectures")
    except (OSError, ValueError, AttributeError):
        return None
    return str(architectures[0]) if isinstance(architectures, list) and architectures else None


def _inspect_legacy(checkpoint_dir: Path) -> Inspection:
    from hf_mcore_bridge.convert.legacy_format import FILE_NAME, LegacySource
    from hf_mcore_bridge.models.registry import get_architecture

    first = sorted(checkpoint_dir.glob(f"mp_rank_*/{FILE_NAME}"))
    if not first:
        raise CheckpointError(f"{checkpoint_dir} holds no mp_rank_*/{FILE_NAME}")
    state = safe_torch_load(first[0], mmap=True)
    if not isinstance(state, dict):
        raise CheckpointError(f"{first[0]} does not hold a dict")
    args = state.get("args")
    architecture = getattr(args, "hf_architecture", None)
    notes = []
    if architecture is None:
        table: tuple = ()
        notes.append("args name no architecture: shapes are those of tensor-parallel rank 0")
    else:
        table = get_architecture(architecture).table
    tied = not getattr(args, "untie_embeddings_and_output_weights", True)
    source = LegacySource(checkpoint_dir, table, tied=tied)
    rows = [_row(key, source.shape(key), source.dtype(key)) for key in sorted(source.keys())]
    return _megatron_inspection(checkpoint_dir, "torch (legacy)", state.get("iteration", "?"), args, rows, notes)


def _megatron_inspection(
    checkpoint_dir: Path, fmt: str, iteration: Any, args: Any, rows: list[TensorRow], notes: list[str]
) -> Inspection:
    layout = {}
    if args is not None:
        for name, arg in (
            ("tp", "tensor_model_parallel_size"),
            ("pp", "pipeline_model_parallel_size"),
            ("vpp", "virtual_pipeline_model_parallel_size"),
            ("cp", "context_parallel_size"),
            ("ep", "expert_model_parallel_size"),
            ("etp", "expert_tensor_parallel_size"),
        ):
            value = getattr(args, arg, None)
            if value is not None:
                layout[name] = value
        padded, vocab = getattr(args, "padded_vocab_size", None), getattr(args, "vocab_size", None)
        if padded and vocab and padded != vocab:
            notes.append(f"vocabulary {vocab} padded to {padded} (parameter count includes the padding)")
    else:
        notes.append("the checkpoint records no args: the layout is unknown")
    if not rows:
        raise CheckpointError(f"{checkpoint_dir} holds no tensors")
    return Inspection(
        path=str(checkpoint_dir),
        format=f"megatron-core {fmt} (iteration {iteration})",
        architecture=getattr(args, "hf_architecture", None) if args is not None else None,
        layout=layout,
        dtypes=sorted({r.dtype for r in rows}),
        parameters=sum(_numel(tuple(r.shape)) for r in rows),
        total_bytes=sum(r.bytes for r in rows),
        tensors=rows,
        notes=notes,
    )
