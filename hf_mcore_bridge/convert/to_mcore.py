"""HF checkpoint -> Megatron-Core distributed checkpoint (`torch_dist`), from one CPU process, streaming.

Assumes the HF directory holds safetensors. Every tensor's shape and dtype is checked against the config (from
the safetensors headers) before the destination is created; a failure while writing names the file and its
cause. A chunk whose bytes are rows of the HF tensors unchanged (same dtype; fused QKV and gate/up only regroup
rows, tensor parallelism cuts rows or columns) is written as byte pieces of the safetensors files, copied in the
kernel (`checkpoint.byte_copy`); which rows, is what the entry type declares (`Entry.mcore_rows`; the tests
check it against the entry's transform). Any other chunk (a cast, a fused expert tensor) is produced when the
writer gets to it and dropped once written: plain tensors are read chunk by chunk (row ranges straight from the
safetensors file), fused ones are built once per layer and reused for their tensor-parallel chunks. Peak memory
is therefore at most about one fused layer tensor per writer thread, whatever the model size. An FP8 checkpoint's
weights are written dequantized, and its scales kept beside the HF assets (`fp8_checkpoint.SCALES_FILE`) for an
FP8 export to give them back.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hf_mcore_bridge.checkpoint import dtypes, writer_contract
from hf_mcore_bridge.checkpoint.byte_copy import Piece, Zeros
from hf_mcore_bridge.checkpoint.dcp_writer import ObjectItem, TensorChunk, write_dcp
from hf_mcore_bridge.checkpoint.destination import check_destination, real_path
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint
from hf_mcore_bridge.checkpoint.megatron_dirs import (
    HF_ASSETS_DIR,
    common_objects,
    common_state,
    installed_mcore_version,
    iteration_dirname,
    write_common,
    write_tracker,
)
from hf_mcore_bridge.checkpoint.row_pieces import Block, joined, region
from hf_mcore_bridge.checkpoint.write_errors import written_atomically
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.bridge_layout import run_config, write_bridge_files
from hf_mcore_bridge.convert.conversion_result import ConversionResult
from hf_mcore_bridge.convert.fp8_checkpoint import SCALES_FILE, Fp8Checkpoint, open_hf_checkpoint
from hf_mcore_bridge.convert.input_checks import check_floating, check_hf_shapes, choose_dtype, hf_sizes
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.convert.model_plan import Placed, check_hf_names, placed_entries
from hf_mcore_bridge.convert.mtp import resolve_import as resolve_mtp
from hf_mcore_bridge.convert.mxfp4_checkpoint import SCALES_FILE as MXFP4_SCALES_FILE
from hf_mcore_bridge.convert.mxfp4_checkpoint import Mxfp4Checkpoint
from hf_mcore_bridge.convert.placement import extra_state_module, placement, split_parts
from hf_mcore_bridge.convert.wrapped import keep_carried
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.mapping_types import Dims, Direct, is_expert, keeps_float32
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.registry import get_architecture
from hf_mcore_bridge.models.row_runs import RowRun
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tensor_ops import shard_boxes, take_box
from hf_mcore_bridge.progress import progress_bar

if TYPE_CHECKING:
    import torch


def check_hf_tensors(
    hf: HFCheckpoint, placed: list[Placed], model: ModelSpec, dtype: str | None
) -> tuple[dtypes.DType, str | None]:
    """Every HF tensor's full shape against the config, then the dtype to write (and a note if that casts);
    tensors kept in float32 (`Direct.float32`) stay out of that choice."""
    expected = {name: shape for p in placed for name, shape in p.entry.hf_expected().items()}
    float32 = {name for p in placed if keeps_float32(p.template) for name in p.hf_names()}

    def info(name: str) -> tuple[tuple[int, ...], str]:
        return hf.info(name).shape, hf.info(name).file.name

    check_hf_shapes(expected, hf_sizes(model, hf.config), info, hf.fused_source)

    def where(name: str) -> str:
        return hf.info(name).file.name

    check_floating({name: hf.info(name).dtype for name in float32}, where)
    choice = choose_dtype(
        {name: hf.info(name).dtype for name in expected if name not in float32},
        where,
        dtypes.FLAGS[dtype] if dtype else None,
        "--dtype",
    )
    return choice.dtype, choice.note


class Producer:
    """Produces megatron-core chunks from the HF checkpoint: as byte pieces of its files where the bytes are
    unchanged, else as tensors, caching the last fused tensor (one per writer thread)."""

    def __init__(self, hf: HFCheckpoint, dims: Dims, dtype: dtypes.DType):
        self.hf, self.dims, self.dtype = hf, dims, dtype
        self._local = threading.local()
        self._layouts: dict[tuple[object, ...], tuple[RowRun, ...] | None] = {}

    def pieces(
        self, placed: Placed, box: tuple[tuple[int, ...], tuple[int, ...]], shape: tuple[int, ...]
    ) -> tuple[Piece, ...] | None:
        """A chunk (`box` of the megatron-core tensor of `shape`) as byte pieces of the HF files, or None when its
        bytes are not rows of them as stored (another dtype, a slice of a fused expert tensor, a computed value)."""
        names, dtype = placed.hf_names(), self.dtype_of(placed)
        if len(shape) not in (1, 2) or any(self.hf.info(n).dtype != dtype for n in names):
            return None
        locations = [self.hf.location(n) for n in names]
        sources = tuple(self.hf.info(n).shape for n in names)
        if any(loc is None for loc in locations) or any(s[1:] != shape[1:] for s in sources):
            return None
        runs = self._row_runs(placed, sources)
        if runs is None or sum(run.count for run in runs) != shape[0]:
            return None
        cols = shape[1] if len(shape) == 2 else 1  # a vector is a matrix of one column
        itemsize = dtype.itemsize
        blocks = {  # each HF tensor is one block, whole, where its safetensors file holds its bytes
            template: [Block(path, offset, 0, source[0], 0, cols)]
            for template, (path, offset), source in zip(placed.template.hf_sources, locations, sources, strict=True)
        }
        (r0, *c_off), (nrows, *c_size) = box
        c0, c1 = (c_off[0], c_off[0] + c_size[0]) if c_off else (0, 1)
        pieces: list[Piece] = []
        for run in runs:
            lo, hi = max(run.start, r0), min(run.start + run.count, r0 + nrows)
            if lo >= hi:
                continue
            if run.source is None:
                pieces.append(Zeros((hi - lo) * (c1 - c0) * itemsize))
                continue
            first = run.source_row + lo - run.start
            found = region(blocks[run.source], (first, first + hi - lo), (c0, c1), itemsize)
            if found is None:
                return None
            pieces += found
        return tuple(joined(pieces))

    def _row_runs(self, placed: Placed, sources: tuple[tuple[int, ...], ...]) -> tuple[RowRun, ...] | None:
        """The megatron-core tensor's rows as runs of HF rows (names as in the template), as the entry type declares
        them, once per entry and shape; None where its layout does not fit the shapes."""
        template = placed.template
        key = (template, sources)
        if key not in self._layouts:
            shapes = dict(zip(template.hf_sources, sources, strict=True))
            try:
                self._layouts[key] = template.mcore_rows(shapes, self.dims)
            except ValueError:
                self._layouts[key] = None
        return self._layouts[key]

    def dtype_of(self, placed: Placed) -> dtypes.DType:
        """The dtype a placed entry is written in: the conversion's, or float32 for `Direct.float32` entries."""
        return dtypes.FLOAT32 if keeps_float32(placed.template) else self.dtype

    def chunk(self, placed: Placed, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
        if isinstance(placed.entry, Direct):
            return self._direct_chunk(placed, box)
        return take_box(self.full(placed), box).clone()

    def full(self, placed: Placed) -> torch.Tensor:
        """The whole megatron-core tensor of one placed entry (kept until this thread asks for the next entry)."""
        name = placed.mcore_name
        cached = getattr(self._local, "cached", None)
        if cached is None or cached[0] != name:
            self._local.cached = cached = None  # drop the previous tensor before building the next
            sources = {n: self.hf.read(n) for n in placed.hf_names()}
            self._local.cached = cached = (
                name,
                placed.entry.to_mcore(sources, self.dims).to(self.dtype_of(placed).torch),
            )
        return cached[1]

    def _direct_chunk(self, placed: Placed, box: tuple[tuple[int, ...], tuple[int, ...]]) -> torch.Tensor:
        (name,) = placed.hf_names()
        offsets, sizes = box
        start, stop = offsets[0], offsets[0] + sizes[0]
        real_stop = min(stop, self.dims.vocab_size) if placed.entry.parallel is Parallel.VOCAB else stop
        rows = self.hf.read(name, (start, real_stop)) if real_stop > start else None
        if rows is not None and len(offsets) > 1:
            rows = rows[(slice(None), *(slice(o, o + s) for o, s in zip(offsets[1:], sizes[1:], strict=True)))]
        import torch

        dtype = self.dtype_of(placed).torch
        rows = rows.to(dtype) if rows is not None else None
        if real_stop == stop:
            return rows.contiguous()
        pad = torch.zeros(stop - max(real_stop, start), *sizes[1:], dtype=dtype)
        return pad if rows is None else torch.cat((rows, pad))


def plan_chunks(
    placed: list[Placed],
    hf: HFCheckpoint,
    model: ModelSpec,
    dims: Dims,
    layout: Layout,
    producer: Producer,
    spec: str = "te",
) -> tuple[list[TensorChunk], list[ObjectItem]]:
    """Every chunk the target ranks will read, and the `_extra_state` objects megatron-core expects.

    Experts are chunked over expert tensor parallelism (ETP), everything else over TP; each (layer, expert)
    is its own chunk on the leading axes, so expert parallelism needs no further split.
    """
    chunks: list[TensorChunk] = []
    objects: dict[str, ObjectItem] = {}
    for p in placed:
        shapes = {n: hf.info(n).shape for n in p.hf_names()}
        shape = p.entry.mcore_shape(shapes, dims)
        where = p.placement(model, spec=spec)
        tp = layout.expert_tp if is_expert(p.template.mcore) else layout.tp
        for key, first, part_shape, box in _part_boxes(p, where.key, shape, dims, tp):
            (row, *rest), sizes = box
            whole = ((first + row, *rest), sizes)  # the chunk in the whole tensor's rows
            produce = _bind(producer, p, whole, leading=len(where.leading))
            pieces = producer.pieces(p, whole, shape)
            offsets, sizes = (*where.leading, row, *rest), ((1,) * len(where.leading) + sizes)
            part_global = (*where.leading_shape, *part_shape)
            chunks.append(TensorChunk(key, part_global, offsets, sizes, producer.dtype_of(p), produce, pieces))
        module = extra_state_module(p.template)
        if module is not None:
            module_where = placement(
                module,
                layer=p.mcore_index,
                expert=p.expert,
                num_layers=model.num_layers,
                num_experts=model.moe.num_experts if model.moe else None,
                stacked=model.homogeneous,
            )
            object_key = module_where.object_key(module_where.key)
            objects.setdefault(object_key, ObjectItem(object_key, [None]))
    return chunks, list(objects.values())


def _part_boxes(
    placed: Placed, key: str, shape: tuple[int, ...], dims: Dims, tp: int
) -> Iterator[tuple[str, int, tuple[int, ...], tuple[tuple[int, ...], tuple[int, ...]]]]:
    """(checkpoint key, first row of the part in the whole tensor, the part's shape, a TP chunk of the part): one
    part, the whole tensor, for most tensors; each saved part (`placement.split_parts`) split over TP on its own
    for megatron-core's split tensors (`Parallel.COLUMN_PARTS`)."""
    parallel = placed.entry.parallel
    if parallel is not Parallel.COLUMN_PARTS:
        for box in shard_boxes(shape, parallel, tp):
            yield key, 0, shape, box
        return
    parts = split_parts(placed.template.mcore, dims)
    if parts is None or sum(rows for _, _, rows in parts) != shape[0]:
        raise CheckpointError(f"{placed.mcore_name}: {shape[0]} rows are not megatron-core's parts of it")
    for part, first, rows in parts:
        part_shape = (rows, *shape[1:])
        for box in shard_boxes(part_shape, Parallel.COLUMN, tp):
            yield f"{key}.{part}", first, part_shape, box


def _bind(producer: Producer, placed: Placed, box, *, leading: int) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        tensor = producer.chunk(placed, box)
        return tensor.reshape((1,) * leading + tuple(tensor.shape))

    return produce


def convert_hf_to_mcore(
    source: Path | str,
    destination: Path | str,
    *,
    layout: Layout | None = None,
    dtype: str | None = None,
    spec: str = "te",
    make_vocab_size_divisible_by: int = 128,
    overwrite: bool = False,
    overwrite_foreign: bool = False,
    ignore_unknown: bool = False,
    allow_pickle: bool = False,
    show_progress: bool = True,
    checkpoint_format: str = "torch_dist",
    mcore_version: int | None = None,
    directory_layout: str = "megatron-lm",
    strict_mtp: bool = False,
) -> ConversionResult:
    """Convert an HF model directory into a Megatron-LM-loadable checkpoint (`release/`).

    `checkpoint_format` is `torch_dist` (megatron-core's distributed checkpoint, loadable at any layout) or
    `torch` (the legacy per-rank files, exactly at `layout`). `mcore_version` (16 .. 19, default: the installed
    megatron-core's) picks the `torch_dist` layout of that megatron-core release (`megatron_dirs`).
    `directory_layout` is `megatron-lm` (`release/`, `args` in the common state) or `megatron-bridge`
    (`iter_0000000/` with `run_config.yaml` and train state instead of `args`: `bridge_layout`). The
    destination is checked before any work (`destination.check_destination`): `overwrite` replaces only an
    output of this tool, `overwrite_foreign` anything. Multi-token-prediction layers megatron-core cannot hold
    are dropped with a notice, or refused with `strict_mtp` (`convert.mtp`). Of a vision-language checkpoint, the
    language model is converted and the rest kept for export, with a notice (`convert.wrapped`).
    """
    if directory_layout not in ("megatron-lm", "megatron-bridge"):
        raise ValueError(f"unknown directory layout {directory_layout!r}")
    if directory_layout == "megatron-bridge" and checkpoint_format != "torch_dist":
        raise ValueError("the Megatron-Bridge layout holds torch_dist checkpoints only")
    check_destination(destination, [source], overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    started = time.perf_counter()
    layout = layout or Layout()
    hf = open_hf_checkpoint(source, allow_pickle=allow_pickle)
    get_architecture(hf.architecture)  # a config without `architectures`, or of an unsupported one, refused by name
    model = config_bridge.megatron_spec(hf.config)
    arch = model.arch
    validate_layout(layout, model)
    if checkpoint_format == "torch":
        from hf_mcore_bridge.convert.legacy_format import check_legacy_layout

        check_legacy_layout(layout, model.moe.num_experts if model.moe else None, spec)
    if directory_layout == "megatron-bridge" and model.mla is not None:
        raise ConfigError(
            "multi-latent attention models are not written in the Megatron-Bridge layout (its run_config.yaml names"
            " them by Megatron-Bridge's DeepSeek providers, not written here); use --layout megatron-lm"
        )
    mtp = resolve_mtp(model, hf, legacy=checkpoint_format == "torch", strict=strict_mtp)
    model = mtp.model
    placed = placed_entries(model)
    if arch.fused_experts:
        hf.add_fused_aliases(
            dict(arch.fused_experts), [(t, p.layer, p.expert) for p in placed for t in p.template.hf_sources]
        )
    check_hf_names(placed, hf.names() - mtp.accepted, model, ignore_unknown=ignore_unknown)
    target_dtype, note = check_hf_tensors(hf, placed, model, dtype)
    padded = config_bridge.padded_vocab(model, layout, make_vocab_size_divisible_by)
    dims = model.dims(padded)
    producer = Producer(hf, dims, target_dtype)
    chunks, objects = plan_chunks(placed, hf, model, dims, layout, producer, spec)
    args = config_bridge.megatron_args(
        model,
        layout,
        target_dtype.torch if checkpoint_format == "torch" else target_dtype,  # the legacy files are torch.saved
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        spec=spec,
        ckpt_format=checkpoint_format,
    )
    # the torch-free writers' bytes against the installed torch's, before anything is written (legacy files are
    # torch.saved: nothing to check)
    contract = writer_contract.verdict() if checkpoint_format == "torch_dist" else writer_contract.Verdict(())
    destination = Path(destination)
    with written_atomically(
        destination,
        sources=[source],
        overwrite=overwrite,
        overwrite_foreign=overwrite_foreign,
        record={"command": "convert --to mcore", "sources": [str(real_path(source))]},
    ) as staging:
        bridge = directory_layout == "megatron-bridge"
        checkpoint_dir = staging / iteration_dirname(0 if bridge else None)
        if checkpoint_format == "torch":
            from hf_mcore_bridge.convert.legacy_format import write_legacy

            files = layout.tp * layout.pp * layout.ep
            with progress_bar("convert to mcore (legacy)", total=files, enabled=show_progress) as step:
                write_legacy(
                    checkpoint_dir,
                    placed,
                    producer.full,
                    layout=layout,
                    num_layers=model.num_layers,
                    num_experts=model.moe.num_experts if model.moe else None,
                    tied=model.tie_word_embeddings,
                    spec=spec,
                    args=args,
                    dims=dims,
                    on_write=step,
                    mla=model.mla is not None,
                )
        else:
            version = mcore_version or installed_mcore_version()
            common = common_state(args, iteration=0)
            if bridge:  # Megatron-Bridge's common state has no `args`: run_config.yaml describes the model
                del common["args"]
            items = [*objects, *common_objects(common, version)]
            with progress_bar("convert to mcore", total=len(chunks) + len(items), enabled=show_progress) as step:
                write_dcp(checkpoint_dir, chunks, items, on_write=step, by_torch=contract.by_torch)
            write_common(checkpoint_dir, common, version, by_torch=contract.by_torch)
        if bridge:
            config = run_config(model, layout, target_dtype, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
            write_bridge_files(staging, checkpoint_dir, config, step=0)
        write_tracker(staging, 0 if bridge else None)
        hf.copy_assets(staging / HF_ASSETS_DIR)
        wrapped_note = keep_carried(hf, staging / HF_ASSETS_DIR)  # a vision-language class: the rest, for export
        if isinstance(hf, Fp8Checkpoint):  # what `--to hf --fp8-blockwise` needs to give the scales back
            hf.save_scales(staging / HF_ASSETS_DIR / SCALES_FILE)
        if isinstance(hf, Mxfp4Checkpoint):  # what `--to hf --mxfp4` needs to give the same bytes back
            hf.save_scales(staging / HF_ASSETS_DIR / MXFP4_SCALES_FILE)
    bytes_written = sum(math.prod(c.sizes) * c.dtype.itemsize for c in chunks)
    seconds = time.perf_counter() - started

    fp8_note = hf.note() if isinstance(hf, Fp8Checkpoint | Mxfp4Checkpoint) else None
    latent_note = config_bridge.latent_norm_note(model)
    notes = tuple(n for n in (wrapped_note, fp8_note, mtp.note, latent_note, note, contract.note) if n)
    return ConversionResult(destination, model, layout, len(chunks), bytes_written, seconds, notes)
