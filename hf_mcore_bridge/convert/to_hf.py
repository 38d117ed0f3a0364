"""Megatron checkpoint (any layout, `torch_dist` or legacy) -> HF model directory, streaming tensor by tensor.

The HF config comes from the checkpoint's stored HF assets, an explicit `--hf-config`, or is rebuilt from the
checkpoint's `args`. Every expected tensor's global shape and dtype is checked against that config before
anything is written, so an `args` that contradicts the tensors is refused up front; a failure while writing
names the file and its cause. Safetensors shards are planned with
`huggingface_hub` (sizes only) and written with their headers first, so memory holds one layer tensor at a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.checkpoint.destination import check_destination, real_path
from hf_mcore_bridge.checkpoint.hf_dir import ASSET_FILES, INDEX_NAME, SINGLE_NAME, read_json
from hf_mcore_bridge.checkpoint.mcore_source import DCPSource, McoreSource
from hf_mcore_bridge.checkpoint.megatron_dirs import hf_assets_dir, read_common, resolve_checkpoint, safe_torch_load
from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsStreamWriter
from hf_mcore_bridge.checkpoint.write_errors import written_atomically
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.bridge_layout import args_from_run_config, is_bridge_checkpoint, read_run_config
from hf_mcore_bridge.convert.config_bridge import DTYPE_NAMES, DTYPES, ModelConfig
from hf_mcore_bridge.convert.input_checks import check_mcore_shape, choose_dtype, megatron_sizes
from hf_mcore_bridge.convert.legacy_format import FILE_NAME, LegacySource
from hf_mcore_bridge.convert.mapping_types import Dims, Entry, Placement, keeps_float32
from hf_mcore_bridge.convert.model_plan import Placed, placed_entries
from hf_mcore_bridge.convert.mtp import without_mtp
from hf_mcore_bridge.convert.to_mcore import ConversionResult
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.mappings import get_architecture
from hf_mcore_bridge.progress import progress_bar


def _is_legacy(checkpoint_dir: Path) -> bool:
    return not (checkpoint_dir / ".metadata").exists() and any(checkpoint_dir.glob("mp_rank_*"))


def open_source(checkpoint_dir: Path, table: tuple[Entry, ...], *, tied: bool) -> McoreSource:
    """The reader for a checkpoint directory's format (the table gives the legacy format its TP styles)."""
    if (checkpoint_dir / ".metadata").exists():
        return DCPSource(checkpoint_dir)
    if _is_legacy(checkpoint_dir):
        return LegacySource(checkpoint_dir, table, tied=tied)
    raise CheckpointError(f"{checkpoint_dir} is neither a torch_dist nor a legacy torch checkpoint")


def checkpoint_args(checkpoint_dir: Path) -> Any:
    """The Megatron-LM `args` a checkpoint carries, or those of its Megatron-Bridge `run_config.yaml` (None for a
    bare megatron-core save)."""
    if _is_legacy(checkpoint_dir):
        first = sorted(checkpoint_dir.glob(f"mp_rank_*/{FILE_NAME}"))
        return safe_torch_load(first[0], mmap=True).get("args") if first else None
    args = read_common(checkpoint_dir).get("args")
    if args is None and is_bridge_checkpoint(checkpoint_dir):
        return args_from_run_config(read_run_config(checkpoint_dir))
    return args


def _hf_config(root: Path, checkpoint_dir: Path, args: Any, hf_config: Path | None) -> dict[str, Any]:
    if hf_config is not None:
        path = hf_config / "config.json" if hf_config.is_dir() else hf_config
        return read_json(path)
    assets = hf_assets_dir(root, checkpoint_dir)
    if assets is not None:
        return read_json(assets / "config.json")
    if args is None:
        raise CheckpointError(f"{checkpoint_dir} has neither HF assets nor args; pass --hf-config")
    model = config_bridge.from_megatron_args(args)
    return config_bridge.to_hf(model, get_architecture(model.architecture))


def _check_against_args(model: ModelConfig, args: Any) -> None:
    if args is None:
        return
    for field, arg in (
        ("num_layers", "num_layers"),
        ("hidden_size", "hidden_size"),
        ("num_attention_heads", "num_attention_heads"),
        ("ffn_hidden_size", "ffn_hidden_size"),
    ):
        value = getattr(args, arg, None)
        if value is not None and value != getattr(model, field):
            raise CheckpointError(f"checkpoint args {arg}={value} contradict the HF config ({getattr(model, field)})")


@dataclass(frozen=True)
class _Planned:
    placed: Placed
    where: Placement
    shape: tuple[int, ...]
    """The tensor's shape without the leading (layer / expert) axes."""
    hf_shapes: dict[str, tuple[int, ...]]


def _plan(placed: list[Placed], source: McoreSource, dims: Dims, model: ModelConfig) -> list[_Planned]:
    """Every placed entry located in the checkpoint, with its shapes checked against the config.

    The layer-spec naming (which differs for MoE layer norms) and the stacking of layers are taken from what the
    checkpoint holds.
    """
    keys = source.keys()
    stacked = source.stacked if source.stacked is not None else model.homogeneous
    candidates = []
    for spec in ("te", "local"):
        wheres = [p.placement(model, spec=spec, stacked=stacked) for p in placed]
        missing = [w.key for w in wheres if w.key not in keys]
        candidates.append((len(missing), missing, wheres))
        if not missing:
            break
    count, missing, wheres = min(candidates, key=lambda c: c[0])
    if count:
        raise CheckpointError(f"{count} tensor(s) missing from the checkpoint, e.g. {missing[0]}")
    sizes = megatron_sizes(model)
    plan = []
    for p, where in zip(placed, wheres, strict=True):
        shape = source.shape(where.key)
        leading = shape[: len(where.leading)]
        if leading != where.leading_shape:
            found, implied = (" x ".join(map(str, dims_)) for dims_ in (leading, where.leading_shape))
            raise CheckpointError(f"{where.key} stacks {found} layers/experts, the config says {implied}")
        entry = p.entry
        check_mcore_shape(
            where.key,
            source.location,
            shape,
            where.leading_shape,
            entry.hf_expected(),
            entry.mcore_shape,
            sizes,
            dims,
        )
        shape = shape[len(where.leading) :]
        plan.append(_Planned(p, where, shape, p.entry.hf_shapes(shape, dims)))
    return plan


def convert_mcore_to_hf(
    source: Path | str,
    destination: Path | str,
    *,
    iteration: int | None = None,
    dtype: str | None = None,
    max_shard_size: str | int = "5GB",
    hf_config: Path | None = None,
    tokenizer: Path | None = None,
    overwrite: bool = False,
    overwrite_foreign: bool = False,
    ignore_unknown: bool = False,
    show_progress: bool = True,
) -> ConversionResult:
    """Export a Megatron checkpoint to an HF model directory (safetensors, config, tokenizer).

    The destination is checked before any work (`destination.check_destination`): `overwrite` replaces only an
    output of this tool, `overwrite_foreign` anything.
    """
    sources = [source, hf_config, tokenizer]
    check_destination(destination, sources, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    from huggingface_hub import split_torch_state_dict_into_shards

    started = time.perf_counter()
    root, checkpoint_dir = resolve_checkpoint(Path(source), iteration)
    args = checkpoint_args(checkpoint_dir)
    config = _hf_config(root, checkpoint_dir, args, hf_config)
    arch = get_architecture(str((config.get("architectures") or ["?"])[0]))
    config, mtp_note = without_mtp(arch, config)  # conversion never writes MTP layers (`convert.mtp`)
    model = config_bridge.from_hf(config, arch)
    mcore = open_source(checkpoint_dir, arch.table, tied=model.tie_word_embeddings)
    _check_against_args(model, args)
    placed = placed_entries(arch, model)
    padded = _padded_vocab(mcore, placed[0].placement(model).key, model)
    dims = model.dims(padded)
    plan = _plan(placed, mcore, dims, model)
    unknown = sorted(mcore.keys() - {planned.where.key for planned in plan})
    if unknown and not ignore_unknown:
        raise CheckpointError(
            f"{len(unknown)} unknown tensor(s) in the checkpoint, e.g. {unknown[0]} (pass --ignore-unknown to skip)"
        )
    out_dtype = DTYPES[dtype] if dtype else None
    keys = {p.where.key: mcore.dtype(p.where.key) for p in plan if not keeps_float32(p.placed.template)}
    choice = choose_dtype(keys, mcore.location, out_dtype, "--dtype")
    specs = {
        name: (shape, torch.float32 if keeps_float32(planned.placed.template) else choice.dtype)
        for planned in plan
        for name, shape in planned.hf_shapes.items()
    }
    split = split_torch_state_dict_into_shards(
        {n: torch.empty(s, dtype=d, device="meta") for n, (s, d) in specs.items()},
        max_shard_size=max_shard_size,
        filename_pattern="model{suffix}.safetensors",
    )
    destination = Path(destination)
    with written_atomically(
        destination,
        sources=sources,
        overwrite=overwrite,
        overwrite_foreign=overwrite_foreign,
        record={"command": "convert --to hf", "sources": [str(real_path(s)) for s in sources if s is not None]},
    ) as staging:
        writers: dict[str, SafetensorsStreamWriter] = {}
        try:
            for file, names in split.filename_to_tensors.items():
                writers[file] = SafetensorsStreamWriter(staging / file, [(n, *specs[n]) for n in names])
            with progress_bar("export to hf", total=len(plan), enabled=show_progress) as advance:
                for planned in plan:
                    tensor = mcore.read(planned.where.key, planned.where.leading)
                    for name, value in planned.placed.entry.to_hf(tensor, dims).items():
                        writers[split.tensor_to_filename[name]].write(name, value.to(specs[name][1]))
                    advance()
        except BaseException:
            for writer in writers.values():
                writer.abandon()  # the failure above is the one to report, not the files it left short
            raise
        for writer in writers.values():
            writer.close()
        if split.is_sharded:
            index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
            (staging / INDEX_NAME).write_text(_json(index))
        elif SINGLE_NAME not in writers:
            (staging / next(iter(writers))).rename(staging / SINGLE_NAME)
        if out_dtype is not None:
            config = {**config, "torch_dtype": DTYPE_NAMES[out_dtype]}
        (staging / "config.json").write_text(_json(config))
        _copy_assets(root, checkpoint_dir, tokenizer, staging)
    total = sum(torch.Size(s).numel() * d.itemsize for s, d in specs.values())
    from hf_mcore_bridge.convert.layout import Layout

    notes = tuple(note for note in (mtp_note, choice.note) if note)
    return ConversionResult(destination, model, Layout(), len(specs), total, time.perf_counter() - started, notes)


def _padded_vocab(source: McoreSource, embedding_key: str, model: ModelConfig) -> int:
    """The checkpoint's padded vocabulary: the rows of its word embedding, at least the config's vocab_size."""
    shape = source.shape(embedding_key)
    if len(shape) != 2 or shape[0] < model.vocab_size:
        raise CheckpointError(
            f"{embedding_key} in {source.location(embedding_key)} has shape {shape}, but the config implies "
            f"(padded vocabulary >= {model.vocab_size}, {model.hidden_size}) (vocab_size={model.vocab_size}, "
            f"hidden_size={model.hidden_size})"
        )
    return shape[0]


def _copy_assets(root: Path, checkpoint_dir: Path, tokenizer: Path | None, staging: Path) -> None:
    import shutil

    sources = [d for d in (tokenizer, hf_assets_dir(root, checkpoint_dir)) if d is not None]
    for name in ASSET_FILES:
        if name == "config.json":
            continue
        for directory in sources:
            if (directory / name).is_file():
                shutil.copy2(directory / name, staging / name)
                break


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=False) + "\n"
