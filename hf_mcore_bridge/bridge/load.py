"""Filling a live megatron-core model from an HF directory of safetensors, each rank reading only what it holds.

For every local tensor (`plan.build_plan`), the rows of the whole megatron-core tensor are runs of HF tensor rows
as the table entry declares them (`Entry.mcore_rows`: fused QKV interleaved per query group, gate then up,
rotary rows permuted, vocabulary padding as zero rows) and the rank holds boxes of it (`tensor_ops.rank_boxes`:
rows for column- and vocabulary-parallel tensors, `[gate_r; up_r]` for a gated MLP, columns for row-parallel
ones, a routed expert's over expert TP). So each rank reads, per HF tensor, the one range of rows its boxes take
(and only their columns), and copies each run into place in the parameter: no full tensor is made, no rank reads
another's slice (`_read` is the single place bytes are read). An FP8 checkpoint (`fp8_checkpoint.
open_hf_checkpoint`) is read dequantized to bfloat16, row range by row range (columns are cut after). The tied
output layer of the last pipeline stage is read as the word embeddings.

Every local tensor must be covered by the table and every HF tensor's shape must fit the model; otherwise one
line names both. Collective: none (each rank reads files by itself).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.bridge.plan import EMBEDDING, Held, Ranks, build_plan, parallel_ranks
from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint
from hf_mcore_bridge.convert.fp8_checkpoint import open_hf_checkpoint
from hf_mcore_bridge.convert.model_plan import Placed, placed_entries
from hf_mcore_bridge.convert.placement import part_rows
from hf_mcore_bridge.errors import BridgeError, CheckpointError
from hf_mcore_bridge.models.mapping_types import Dims
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.row_runs import RowRun
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tensor_ops import Box, global_shape, rank_boxes

if TYPE_CHECKING:
    import torch

Columns = tuple[int, int] | None
"""A column range [start, stop) of a 2-D tensor, or None for all columns."""


@dataclass(frozen=True)
class _Copy:
    """Local rows [local_row, local_row + count) are HF `source`'s rows [source_row, ...) (zeros: source None)."""

    local_row: int
    count: int
    source: str | None
    source_row: int


def open_checkpoint(hf_dir: Path | str, model_cfg: ModelSpec) -> HFCheckpoint:
    """An HF directory, FP8-aware, with per-expert names served from fused expert tensors where only those are
    stored (as conversion reads it)."""
    hf = open_hf_checkpoint(hf_dir)
    arch = model_cfg.arch
    if arch.fused_experts:
        wanted = [(t, p.layer, p.expert) for p in placed_entries(model_cfg) for t in p.template.hf_sources]
        hf.add_fused_aliases(dict(arch.fused_experts), wanted)
    return hf


def load_hf_weights(models: Any, model_cfg: ModelSpec, hf_dir: Path | str) -> None:
    """Fill every parameter and persistent buffer of `models` (a model or its virtual-pipeline chunks, any
    layout, CPU or GPU) from the HF directory `hf_dir`, reading only this rank's slices."""
    import torch

    ranks = parallel_ranks()
    plan = build_plan(models, model_cfg, ranks)
    problem = plan.problem(model_cfg.architecture)
    if problem is not None:
        raise BridgeError(problem)
    hf = open_checkpoint(hf_dir, model_cfg)
    dims = model_cfg.dims(plan.padded_vocab or model_cfg.vocab_size)
    tied = [Held(_embedding(model_cfg), tensor, name) for name, tensor in plan.tied]
    with torch.no_grad():
        for held in (*plan.held, *tied):
            _fill(hf, held, dims, ranks)


def _embedding(model_cfg: ModelSpec) -> Placed:
    """The word embeddings' table entry (what a tied output layer holds)."""
    return next(placed for placed in placed_entries(model_cfg) if placed.mcore_name == EMBEDDING)


def _fill(hf: HFCheckpoint, held: Held, dims: Dims, ranks: Ranks) -> None:
    """Copy this rank's part of one table entry from the checkpoint into its local tensor."""
    entry, target = held.placed.entry, held.tensor
    shapes = {name: hf.info(name).shape for name in entry.hf_sources}
    try:
        whole = entry.mcore_shape(shapes, dims)
    except CheckpointError as err:  # the checkpoint is not of the model the bridge describes
        raise CheckpointError(f"{hf.path}: {err}") from None
    size, rank = ranks.split(held.expert)
    expected = global_shape(tuple(target.shape), entry.parallel, size)
    if tuple(whole) != expected:
        raise CheckpointError(
            f"{', '.join(entry.hf_sources)} in {hf.path} make a {tuple(whole)} tensor, but the model's {held.name} "
            f"is {tuple(target.shape)} on each of {size} tensor-parallel ranks ({expected} in all)"
        )
    boxes = rank_boxes(tuple(whole), entry.parallel, size, rank, part_rows(held.placed.template.mcore, dims))
    copies = _copies(entry.mcore_rows(shapes, dims), boxes)
    columns = _columns(boxes, tuple(whole)) if entry.parallel is Parallel.ROW else None
    spans = _spans(copies)
    rows = {(name, span): _read(hf, name, span, columns) for name, span in set(spans.values())}
    for index, copy in enumerate(copies):
        local = target[copy.local_row : copy.local_row + copy.count]
        if copy.source is None:
            local.zero_()
            continue
        name, span = spans[index]
        start = copy.source_row - span[0]
        local.copy_(rows[(name, span)][start : start + copy.count])


def _spans(copies: list[_Copy]) -> dict[int, tuple[str, tuple[int, int]]]:
    """Copy index -> (HF tensor, rows [start, stop) read for it): the rows of one tensor that this rank's copies
    take, adjacent or overlapping ones read together, separate ones apart (a tensor megatron-core splits part by
    part puts other ranks' rows between this rank's)."""
    by_source: dict[str, list[int]] = {}
    for index, copy in enumerate(copies):
        if copy.source is not None:
            by_source.setdefault(copy.source, []).append(index)
    spans: dict[int, tuple[str, tuple[int, int]]] = {}
    for name, indices in by_source.items():
        indices.sort(key=lambda i: copies[i].source_row)
        groups: list[tuple[list[int], int, int]] = []
        for i in indices:
            start, stop = copies[i].source_row, copies[i].source_row + copies[i].count
            if groups and start <= groups[-1][2]:
                members, first, last = groups[-1]
                groups[-1] = ([*members, i], first, max(last, stop))
            else:
                groups.append(([i], start, stop))
        for members, first, last in groups:
            for i in members:
                spans[i] = (name, (first, last))
    return spans


def _copies(runs: Iterable[RowRun], boxes: list[Box]) -> list[_Copy]:
    """The local tensor's rows as copies of HF rows: its boxes stacked on dim 0 (`[gate_r; up_r]`), each box's
    rows cut from the runs of the whole tensor's rows."""
    runs = list(runs)
    copies: list[_Copy] = []
    local_row = 0
    for offsets, sizes in boxes:
        first, stop = offsets[0], offsets[0] + sizes[0]
        for run in runs:
            lo, hi = max(run.start, first), min(run.start + run.count, stop)
            if lo < hi:
                row = run.source_row + lo - run.start if run.source is not None else 0
                copies.append(_Copy(local_row + lo - first, hi - lo, run.source, row))
        local_row += sizes[0]
    return copies


def _columns(boxes: list[Box], whole: tuple[int, ...]) -> Columns:
    """The columns a row-parallel rank holds (one box), None where that is all of them."""
    ((offsets, sizes),) = boxes
    return None if sizes[1] == whole[1] else (offsets[1], offsets[1] + sizes[1])


def _read(hf: HFCheckpoint, name: str, rows: tuple[int, int], columns: Columns) -> torch.Tensor:
    """Rows [start, stop) of an HF tensor, only `columns` of them where given: straight from the safetensors file
    where the tensor is stored as it is, else through the checkpoint's reader (FP8 dequantized, a slice of a fused
    expert tensor), its columns cut after."""
    if columns is None:
        return hf.read(name, rows)
    if hf.location(name) is None:
        return hf.read(name, rows)[:, columns[0] : columns[1]]
    from safetensors import safe_open

    with safe_open(str(hf.info(name).file), framework="pt") as handle:
        return handle.get_slice(name)[rows[0] : rows[1], columns[0] : columns[1]]
