"""Megatron checkpoint (any layout, `torch_dist` or legacy) -> HF model directory, streaming tensor by tensor.

The HF config comes from the checkpoint's stored HF assets, an explicit `--hf-config`, or is rebuilt from the
checkpoint's `args`. Every expected tensor's global shape and dtype is checked against that config before
anything is written, so an `args` that contradicts the tensors is refused up front; a failure while writing
names the file and its cause. Safetensors shards are planned with `huggingface_hub` (sizes only), so every
tensor's place in its file is known before anything is written. A tensor whose rows are stored unchanged in a
`torch_dist` checkpoint (the output dtype; splitting QKV or gate/up and joining tensor-parallel chunks only
regroups rows and columns) is copied from the data files in the kernel (`checkpoint.byte_copy`); which rows, is
what the entry type declares (`Entry.hf_rows`; the tests check it against the entry's transform). Any other
tensor is read and transformed when its turn comes, so memory holds at most one layer tensor per writer thread.
Shards are written in parallel by two writer threads (`checkpoint.parallel_write`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes, expert_parts
from hf_mcore_bridge.checkpoint.byte_copy import Piece, Produced, Zeros, length_of
from hf_mcore_bridge.checkpoint.destination import check_destination, real_path
from hf_mcore_bridge.checkpoint.hf_dir import ASSET_FILES, INDEX_NAME, SINGLE_NAME, read_json
from hf_mcore_bridge.checkpoint.mcore_source import DCPSource, McoreSource
from hf_mcore_bridge.checkpoint.megatron_dirs import hf_assets_dir, read_common, resolve_checkpoint, safe_torch_load
from hf_mcore_bridge.checkpoint.mxfp4 import BLOCK as MXFP4_BLOCK
from hf_mcore_bridge.checkpoint.mxfp4 import quantize as mxfp4_quantize
from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.checkpoint.parallel_write import Job, run_jobs
from hf_mcore_bridge.checkpoint.row_pieces import Block, joined, region
from hf_mcore_bridge.checkpoint.safetensors_stream import SafetensorsLayout
from hf_mcore_bridge.checkpoint.write_errors import written_atomically
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.bridge_layout import args_from_run_config, is_bridge_checkpoint, read_run_config
from hf_mcore_bridge.convert.conversion_result import ConversionResult
from hf_mcore_bridge.convert.input_checks import check_mcore_shape, choose_dtype, megatron_sizes
from hf_mcore_bridge.convert.model_plan import Placed, placed_entries
from hf_mcore_bridge.convert.mtp import copies as mtp_copies
from hf_mcore_bridge.convert.mtp import resolve_export
from hf_mcore_bridge.convert.mxfp4_checkpoint import SCALES_FILE as MXFP4_SCALES_FILE
from hf_mcore_bridge.convert.mxfp4_checkpoint import is_mxfp4_config, mxfp4_quantization_config
from hf_mcore_bridge.convert.placement import Placement
from hf_mcore_bridge.convert.wrapped import WrappedExport
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.mapping_types import Dims, Entry, keeps_float32
from hf_mcore_bridge.models.row_runs import RowRun
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.progress import progress_bar

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Export


def _is_legacy(checkpoint_dir: Path) -> bool:
    return not (checkpoint_dir / ".metadata").exists() and any(checkpoint_dir.glob("mp_rank_*"))


def open_source(checkpoint_dir: Path, table: tuple[Entry, ...], *, tied: bool, dims: Dims | None = None) -> McoreSource:
    """The reader for a checkpoint directory's format (the table gives the legacy format its TP styles, `dims` the
    rows of the parts of Gated DeltaNet's tensors sharded part by part)."""
    if (checkpoint_dir / ".metadata").exists():
        return DCPSource(checkpoint_dir)
    if _is_legacy(checkpoint_dir):
        from hf_mcore_bridge.convert.legacy_format import LegacySource

        return LegacySource(checkpoint_dir, table, tied=tied, dims=dims)
    raise CheckpointError(f"{checkpoint_dir} is neither a torch_dist nor a legacy torch checkpoint")


def checkpoint_args(checkpoint_dir: Path) -> Any:
    """The Megatron-LM `args` a checkpoint carries, or those of its Megatron-Bridge `run_config.yaml` (None for a
    bare megatron-core save)."""
    if _is_legacy(checkpoint_dir):
        from hf_mcore_bridge.convert.legacy_format import FILE_NAME

        first = sorted(checkpoint_dir.glob(f"mp_rank_*/{FILE_NAME}"))
        return safe_torch_load(first[0], mmap=True).get("args") if first else None
    args = read_common(checkpoint_dir, torch_free=True).get("args")
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
    return config_bridge.from_megatron_args(args).to_hf()


def _check_against_args(model: ModelSpec, args: Any) -> None:
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


def _plan(placed: list[Placed], source: McoreSource, dims: Dims, model: ModelSpec) -> list[_Planned]:
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
    fp8_blockwise: bool = False,
    fp8_scale_format: str = "source",
    mxfp4: bool = False,
    lora_base: bool = False,
) -> ConversionResult:
    """Export a Megatron checkpoint to an HF model directory (safetensors, config, tokenizer).

    The destination is checked before any work (`destination.check_destination`): `overwrite` replaces only an
    output of this tool, `overwrite_foreign` anything. `fp8_blockwise` writes the linear layers' weights as
    128 x 128 FP8 blocks with `weight_scale_inv` (`fp8_checkpoint.Fp8Export`) of `fp8_scale_format` (`source`:
    the FP8 source's, kept where the checkpoint's HF assets hold its scales; `ue8m0`; `float32`); otherwise every
    tensor is written in the export dtype and a `quantization_config` the source config carried is dropped.
    `mxfp4` writes fused expert weights (`Architecture.fused_checkpoint`) as MXFP4 blocks and scales, the source's
    scales where the checkpoint's HF assets kept them (`mxfp4_checkpoint.SCALES_FILE`): bit-identical for weights
    that came from MXFP4. A LoRA run's checkpoint (adapter tensors `*.lora.lora_*` beside the base) is refused,
    naming `bridge export`, unless `lora_base`: then its frozen base weights are written (the adapters skipped).
    """
    sources = [source, hf_config, tokenizer]
    check_destination(destination, sources, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    from huggingface_hub.serialization import split_state_dict_into_shards_factory

    started = time.perf_counter()
    root, checkpoint_dir = resolve_checkpoint(Path(source), iteration)
    args = checkpoint_args(checkpoint_dir)
    config = _hf_config(root, checkpoint_dir, args, hf_config)
    wrapped = WrappedExport.of(config, hf_assets_dir(root, checkpoint_dir))  # a vision-language class, written whole
    original_config = wrapped.text_config() if wrapped else config
    model = config_bridge.megatron_spec(config)
    # the parts' rows depend on the linear-attention heads only, not on the (yet unknown) padded vocabulary
    part_dims = model.dims(model.vocab_size)
    mcore = open_source(checkpoint_dir, model.arch.table, tied=model.tie_word_embeddings, dims=part_dims)
    _check_against_args(model, args)
    model, mtp_note = resolve_export(model, mcore.keys())
    placed = placed_entries(model)
    padded = _padded_vocab(mcore, placed[0].placement(model).key, model)
    dims = model.dims(padded)
    plan = _plan(placed, mcore, dims, model)
    held = mcore.keys()
    adapters = {key for key in held if ".lora.lora_" in key}
    if adapters and not lora_base:
        raise CheckpointError(
            f"{checkpoint_dir} is a LoRA run's checkpoint (adapters such as {min(adapters)}): `bridge export RUN DEST`"
            " writes its merged weights, `bridge export --peft` its adapters"
        )
    unknown = sorted(held - adapters - {planned.where.key for planned in plan})
    if unknown and not ignore_unknown:
        raise CheckpointError(
            f"{len(unknown)} unknown tensor(s) in the checkpoint, e.g. {unknown[0]} (pass --ignore-unknown to skip)"
        )
    out_dtype = dtypes.FLAGS[dtype] if dtype else None
    keys = {p.where.key: mcore.dtype(p.where.key) for p in plan if not keeps_float32(p.placed.template)}
    choice = choose_dtype(keys, mcore.location, out_dtype, "--dtype")

    def dtype_of(planned: _Planned) -> dtypes.DType:
        return dtypes.FLOAT32 if keeps_float32(planned.placed.template) else choice.dtype

    quantized_source = original_config.get("quantization_config") is not None
    fp8: Fp8Export | None = None
    if fp8_blockwise or (quantized_source and not is_mxfp4_config(original_config)):  # FP8: made and checked with torch
        from hf_mcore_bridge.convert.fp8_checkpoint import Fp8Export, is_fp8_config

        quantized_source = is_fp8_config(original_config)
        if fp8_blockwise:
            assets = hf_assets_dir(root, checkpoint_dir)
            fp8 = Fp8Export.of_checkpoint((p.entry for p in placed), fp8_scale_format, original_config, assets)
    copied: dict[str, list[str]] = {}  # a shared tensor -> the MTP layers' copies of it
    for copy, original in mtp_copies(model).items():
        copied.setdefault(original, []).append(copy)
    specs: dict[str, tuple[tuple[int, ...], dtypes.DType]] = {}
    for planned in plan:
        for name, shape in planned.hf_shapes.items():
            dtype_ = dtype_of(planned)
            own = fp8.specs(name, shape, dtype_) if fp8 else [(name, shape, dtype_)]
            for spec_name, spec_shape, spec_dtype in own + [(c, shape, dtype_) for c in copied.get(name, [])]:
                specs[spec_name] = (spec_shape, dtypes.of(spec_dtype))
    fused = _fused_members(model, plan) if model.arch.fused_checkpoint else {}
    if fused and fp8 is not None:
        raise CheckpointError(f"{model.arch.hf_name}'s fused experts are not written as FP8 blocks")
    for fused_name, experts in fused.items():
        planned, name, part = experts[0][0]
        shape, dtype_ = specs[name]
        for members in experts:
            for _, member, _ in members:
                del specs[member]
        specs[fused_name] = ((len(experts), *expert_parts.fused_shape(part, shape)), dtype_)
    packed = _packed_specs(specs, fused) if mxfp4 else {}
    if mxfp4 and not packed:
        raise CheckpointError(f"--mxfp4: {model.arch.hf_name} has no fused expert weights to write as MXFP4")
    for name, (blocks, scales) in packed.items():
        experts, in_features, out_features = specs.pop(name)[0]
        groups = in_features // MXFP4_BLOCK
        specs[blocks] = ((experts, out_features, groups, MXFP4_BLOCK // 2), dtypes.UINT8)
        specs[scales] = ((experts, out_features, groups), dtypes.UINT8)
    out_name = wrapped.name if wrapped else str  # the text tensors' names in the written checkpoint
    carried = {c.name: c for c in wrapped.carried} if wrapped else {}
    written = {out_name(n): spec for n, spec in specs.items()} | {c.name: (c.shape, c.dtype) for c in carried.values()}
    split = split_state_dict_into_shards_factory(  # huggingface_hub's sharding, on sizes (its torch variant
        {n: _nbytes(s, d) for n, (s, d) in written.items()},  # imports torch.distributed.tensor to look for DTensors)
        get_storage_size=lambda nbytes: nbytes,
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
        layouts = {
            file: SafetensorsLayout([(n, *written[n]) for n in names])
            for file, names in split.filename_to_tensors.items()
        }
        queues = {file: [Job(staging / file, 0, (layout.header,))] for file, layout in layouts.items()}
        tensors = _Tensors(mcore, dims, specs, dtype_of, fp8, copied)
        members = {name for experts in fused.values() for group in experts for _, name, _ in group}
        for planned in plan:
            if members.issuperset(planned.hf_shapes):
                continue
            for text, pieces in tensors.pieces(planned).items():
                file = split.tensor_to_filename[out_name(text)]
                queues[file].append(Job(staging / file, layouts[file].place(out_name(text))[0], pieces))
        for carried_tensor in carried.values():  # the wrapper's own tensors: their bytes as the source held them
            file = split.tensor_to_filename[carried_tensor.name]
            queues[file].append(
                Job(staging / file, layouts[file].place(carried_tensor.name)[0], (carried_tensor.span,))
            )
        kept = hf_assets_dir(root, checkpoint_dir) / MXFP4_SCALES_FILE if packed else None
        for fused_name, experts in fused.items():
            outputs = (
                {fused_name: None}
                if fused_name not in packed
                else dict(zip(packed[fused_name], ("blocks", "scales"), strict=True))
            )
            for out, what in outputs.items():
                file = split.tensor_to_filename[out_name(out)]
                pieces = tuple(tensors.fused_piece(group, what, kept, packed.get(fused_name)) for group in experts)
                queues[file].append(Job(staging / file, layouts[file].place(out_name(out))[0], pieces))
        with progress_bar("export to hf", total=len(written) + len(queues), enabled=show_progress) as advance:
            run_jobs(_in_turns(list(queues.values()), WRITERS), on_done=advance)  # steps: headers and tensors
        if split.is_sharded:
            index = {"metadata": dict(split.metadata), "weight_map": dict(split.tensor_to_filename)}
            (staging / INDEX_NAME).write_text(_json(index))
        elif SINGLE_NAME not in queues:
            (staging / next(iter(queues))).rename(staging / SINGLE_NAME)

        def exported(text: dict[str, Any]) -> dict[str, Any]:
            text = {k: v for k, v in text.items() if k != "quantization_config"}
            if packed:
                text["quantization_config"] = mxfp4_quantization_config(original_config, model)
            if fp8 is not None:
                text["quantization_config"] = fp8.quantization_config()
            if out_dtype is not None or quantized_source:
                text = {**text, "torch_dtype": choice.dtype.name}
            if mtp_note is not None:
                text["num_nextn_predict_layers"] = model.mtp_layers
            return text

        config = wrapped.config_with(exported) if wrapped else exported(config)
        _write_config(
            staging / "config.json", config, hf_assets_dir(root, checkpoint_dir) if hf_config is None else None
        )
        _copy_assets(root, checkpoint_dir, tokenizer, staging)
    total = sum(_nbytes(s, d) for s, d in written.values())
    from hf_mcore_bridge.convert.layout import Layout

    notes = tuple(note for note in (mtp_note, choice.note) if note)
    return ConversionResult(destination, model, Layout(), len(written), total, time.perf_counter() - started, notes)


Member = tuple["_Planned", str, str]
"""A per-expert HF tensor written as a part of a fused one: (its planned entry, its name, its part)."""


def _fused_members(model: ModelSpec, plan: list[_Planned]) -> dict[str, list[list[Member]]]:
    """The fused tensors an architecture's checkpoint stores (`Architecture.fused_checkpoint`): fused name -> per
    expert, in order, the per-expert tensors that make its slice (`expert_parts.join`)."""
    rules = model.arch.fused_experts or {}
    fused: dict[str, dict[int, list[Member]]] = {}
    for planned in plan:
        placed = planned.placed
        for template, name in zip(placed.template.hf_sources, placed.hf_names(), strict=True):
            if template not in rules or placed.expert is None:
                continue
            fused_template, part = rules[template]
            experts = fused.setdefault(fill(fused_template, placed.layer, None), {})
            experts.setdefault(placed.expert, []).append((planned, name, part))
    out = {}
    for name, experts in fused.items():
        if sorted(experts) != list(range(len(experts))):
            raise CheckpointError(f"{name}: experts {sorted(experts)} are not 0 .. {len(experts) - 1}")
        out[name] = [experts[e] for e in range(len(experts))]
    return out


class _Tensors:
    """The HF tensors of each planned entry, as byte pieces: of the checkpoint's data files where the entry's rows
    are stored there unchanged (a `torch_dist` checkpoint of the output dtype), else produced from the tensor read
    and transformed when its turn comes (one entry's tensors cached per writer thread). Tensors written as FP8
    blocks (`fp8`) are always produced; the MTP layers' copies of a tensor (`copied`) are its pieces again."""

    def __init__(
        self,
        source: McoreSource,
        dims: Dims,
        specs: dict[str, tuple[tuple[int, ...], dtypes.DType]],
        dtype_of: Callable[[_Planned], dtypes.DType],
        fp8: Fp8Export | None = None,
        copied: dict[str, list[str]] | None = None,
    ):
        self.source, self.dims, self.specs, self.dtype_of = source, dims, specs, dtype_of
        self.fp8, self.copied = fp8, copied or {}
        self._local = threading.local()
        self._raw: dict[tuple[str, int], dict[tuple[int, ...] | None, list[RawChunk]] | None] = {}
        self._layouts: dict[tuple[object, ...], dict[str, tuple[RowRun, ...]] | None] = {}

    def pieces(self, planned: _Planned) -> dict[str, tuple[Piece, ...]]:
        quantized = self.fp8 is not None and any(name in self.fp8.names for name in planned.hf_shapes)
        out = None if quantized else self._copied(planned)
        if out is None:
            names = [
                spec[0]
                for name, shape in planned.hf_shapes.items()
                for spec in (self.fp8.specs(name, shape, self.specs[name][1]) if self.fp8 else [(name,)])
            ]
            out = {name: (Produced(_nbytes(*self.specs[name]), self._producer(planned, name)),) for name in names}
        for name in list(out):
            out |= {copy: out[name] for copy in self.copied.get(name, ())}
        return out

    def _copied(self, planned: _Planned) -> dict[str, tuple[Piece, ...]] | None:
        if not isinstance(self.source, DCPSource) or len(planned.shape) not in (1, 2):
            return None
        if self.source.is_split(planned.where.key):  # served from parts: produced, not copied
            return None
        key, dtype = planned.where.key, self.source.dtype(planned.where.key)
        if any(self.specs[n][1] != dtype or shape[1:] != planned.shape[1:] for n, shape in planned.hf_shapes.items()):
            return None
        leading = planned.where.leading
        if (key, len(leading)) not in self._raw:
            self._raw[(key, len(leading))] = _by_leading(self.source.dcp.raw_chunks(key), len(leading))
        raw = self._raw[(key, len(leading))]
        candidates = None if raw is None else [*raw.get(leading, ()), *raw.get(None, ())]
        blocks = None if candidates is None else _blocks(candidates, leading, len(planned.shape), dtype.itemsize)
        runs = self._row_runs(planned)
        if blocks is None or runs is None:
            return None
        cols = planned.shape[1] if len(planned.shape) == 2 else 1
        template = planned.placed.template
        out = {}
        for template_name, name in zip(template.hf_sources, planned.placed.hf_names(), strict=True):
            pieces: list[Piece] = []
            if sum(run.count for run in runs[template_name]) != planned.hf_shapes[name][0]:
                return None
            for run in runs[template_name]:
                if run.source is None:
                    pieces.append(Zeros(run.count * cols * dtype.itemsize))
                    continue
                found = region(blocks, (run.source_row, run.source_row + run.count), (0, cols), dtype.itemsize)
                if found is None:
                    return None
                pieces += found
            out[name] = tuple(joined(pieces))
        return out

    def _row_runs(self, planned: _Planned) -> dict[str, tuple[RowRun, ...]] | None:
        """Each HF tensor's rows as runs of the megatron-core tensor's rows (names as in the template), as the entry
        type declares them; None where its layout does not fit the shape."""
        template = planned.placed.template
        key = (template, planned.shape)
        if key not in self._layouts:
            try:
                self._layouts[key] = template.hf_rows(planned.shape, self.dims)
            except ValueError:
                self._layouts[key] = None
        return self._layouts[key]

    def _value(self, planned: _Planned, name: str) -> Any:
        """The HF tensor `name` of a planned entry, in the output dtype (the entry's tensors cached per thread)."""
        cached = getattr(self._local, "cached", None)
        if cached is None or cached[0] is not planned:
            self._local.cached = cached = None  # drop the previous entry's tensors first
            tensor = self.source.read(planned.where.key, planned.where.leading)
            dtype = self.dtype_of(planned).torch
            values = planned.placed.entry.to_hf(tensor, self.dims)
            written = {
                out: part
                for hf_name, value in values.items()
                for out, part in (
                    self.fp8.tensors(hf_name, value.to(dtype)) if self.fp8 else [(hf_name, value.to(dtype))]
                )
            }
            self._local.cached = cached = (planned, written)
        return cached[1][name]

    def _producer(self, planned: _Planned, name: str) -> Callable[[], Any]:
        def produce() -> Any:
            import torch

            shape, dtype = self.specs[name]
            value = self._value(planned, name)
            if tuple(value.shape) != shape or dtypes.of(value.dtype) != dtype:
                raise AssertionError(f"{name}: got {tuple(value.shape)} {value.dtype}, declared {shape} {dtype}")
            return value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()

        return produce

    def fused_piece(
        self,
        members: list[Member],
        packed: str | None = None,
        kept: Path | None = None,
        names: tuple[str, str] | None = None,
    ) -> Produced:
        """One expert's slice of a fused tensor, made when its turn comes from its per-expert tensors; with
        `packed` (`blocks` or `scales`), that part of its MXFP4 form, with the source's scales where `kept` holds
        them under `names[1]`."""
        planned, name, part = members[0]
        shape = expert_parts.fused_shape(part, tuple(planned.hf_shapes[name]))
        expert = planned.placed.expert

        def value() -> Any:
            joined = expert_parts.join({part: self._value(p, n) for p, n, part in members})
            if tuple(joined.shape) != shape:
                raise AssertionError(f"{name}'s fused slice: got {tuple(joined.shape)}, declared {shape}")
            return joined

        def produce() -> Any:
            import torch

            out = value()
            if packed is not None and names is not None:
                try:  # the source's scales give its bytes back; trained weights need their own
                    blocks, scales = mxfp4_quantize(out.T, _kept_scales(kept, names[1], expert))
                except ValueError:
                    blocks, scales = mxfp4_quantize(out.T)
                out = blocks if packed == "blocks" else scales
            return out.detach().contiguous().reshape(-1).view(torch.uint8).numpy()

        if packed is None:
            return Produced(_nbytes(shape, self.dtype_of(planned)), produce)
        rows, groups = shape[1], shape[0] // MXFP4_BLOCK
        return Produced(rows * groups * (MXFP4_BLOCK // 2 if packed == "blocks" else 1), produce)


def _kept_scales(kept: Path | None, name: str, expert: int | None) -> Any:
    """One expert's slice of the source's MXFP4 scales `name`, where the HF assets kept them; else None."""
    if kept is None or expert is None or not kept.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(kept), framework="pt") as handle:
        if name not in handle.keys():  # noqa: SIM118 (safe_open has no __contains__)
            return None
        return handle.get_slice(name)[expert : expert + 1][0]


def _packed_specs(
    specs: dict[str, tuple[tuple[int, ...], dtypes.DType]], fused: dict[str, list[list[Member]]]
) -> dict[str, tuple[str, str]]:
    """The fused tensors written as MXFP4 (those of 2-D expert slices: the weights, not the biases) -> their
    blocks and scales names."""
    return {name: (name + "_blocks", name + "_scales") for name in fused if len(specs[name][0]) == 3}


RawChunk = tuple[tuple[int, ...], tuple[int, ...], Path, int]
"""A stored chunk: (offsets, sizes, data file, where its raw bytes start), as `DCPCheckpoint.raw_chunks` gives it."""


def _by_leading(raw: list[RawChunk] | None, leading: int) -> dict[tuple[int, ...] | None, list[RawChunk]] | None:
    """Chunks by their leading (layer / expert) offsets where they hold one index of each leading axis (as
    megatron-core and this tool save them), under None otherwise: each entry then looks only at its own."""
    if raw is None:
        return None
    index: dict[tuple[int, ...] | None, list[RawChunk]] = {}
    for chunk in raw:
        offsets, sizes = chunk[0], chunk[1]
        single = len(sizes) >= leading and all(size == 1 for size in sizes[:leading])
        index.setdefault(tuple(offsets[:leading]) if single else None, []).append(chunk)
    return index


def _blocks(raw: list[RawChunk], leading: tuple[int, ...], rank: int, itemsize: int) -> list[Block] | None:
    """The chunks holding the tensor at these leading (layer / expert) indices, as blocks of its matrix (a vector
    as one column), or None when a chunk is not of that form."""
    blocks = []
    for offsets, sizes, path, start in raw:
        if len(offsets) != len(leading) + rank:
            return None
        if not all(o <= i < o + n for i, o, n in zip(leading, offsets, sizes, strict=False)):
            continue
        flat, step = 0, 1
        for index in reversed(range(len(sizes))):
            if index < len(leading):
                flat += (leading[index] - offsets[index]) * step
            step *= sizes[index]
        row, nrows = offsets[len(leading)], sizes[len(leading)]
        col, ncols = (offsets[-1], sizes[-1]) if rank == 2 else (0, 1)
        blocks.append(Block(path, start + flat * itemsize, row, nrows, col, ncols))
    return blocks


WRITERS = 2
"""Writer threads of an export, each writing whole shards (the writes into one file serialize on its inode lock)."""


def _in_turns(queues: list[list[Job]], writers: int) -> list[list[Job]]:
    """The shards' queues dealt to `writers` threads, consecutive shards of about equal size to each."""
    sizes = [sum(sum(length_of(p) for p in job.pieces) for job in queue) for queue in queues]
    total, done = sum(sizes), 0
    turns: list[list[Job]] = [[] for _ in range(writers)]
    for queue, size in zip(queues, sizes, strict=True):
        turns[min(done * writers // total, writers - 1) if total else 0].extend(queue)
        done += size
    return [turn for turn in turns if turn]


def _nbytes(shape: tuple[int, ...], dtype: dtypes.DType) -> int:
    count = dtype.itemsize
    for dim in shape:
        count *= dim
    return count


def _padded_vocab(source: McoreSource, embedding_key: str, model: ModelSpec) -> int:
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


def _write_config(path: Path, config: dict[str, Any], assets: Path | None) -> None:
    """The exported config: the source's `config.json` file itself where nothing in it changed."""
    import shutil

    if assets is not None and read_json(assets / "config.json") == config:
        shutil.copy2(assets / "config.json", path)
    else:
        path.write_text(_json(config))


def _json(data: dict[str, Any]) -> str:
    import json

    return json.dumps(data, indent=2, sort_keys=False) + "\n"
