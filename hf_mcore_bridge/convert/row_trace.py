"""Which input row each output row of a table entry's transform is, found by running the transform on row tags.

The byte-copy path of a conversion (`checkpoint.byte_copy`) needs to know, for each output tensor, which input
tensor and row every output row is a copy of. Rather than restating each entry type's layout (QKV interleaving,
gate/up halves, vocabulary padding), `trace` runs the entry's own transform on small integer tensors whose
values name their input and row (and column), and reads the answer off the result. Each input row is given a few
columns, each tagged with its column number, so a transform that moves columns or computes new values is seen as
not a row gather, and the caller falls back to transforming real tensors. Zero rows in the output (vocabulary
padding) come out as rows of no input.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

_COLUMNS = 3
_ROW_BITS = 40


@dataclass(frozen=True)
class RowRun:
    """Output rows [start, start + count) are input `source`'s rows [source_row, source_row + count); with
    `source` None, they are zeros."""

    start: int
    count: int
    source: str | None
    source_row: int


def trace(
    transform: Callable[[Mapping[str, torch.Tensor]], Mapping[str, torch.Tensor]],
    inputs: Mapping[str, tuple[int, ...]],
) -> dict[str, tuple[RowRun, ...]] | None:
    """Run `transform` (inputs by name -> outputs by name) on tags of inputs of these shapes; for each output, its
    rows as runs of input rows, or None when some output is not made of whole input rows (in the inputs' order
    of columns) or an input is not a vector or matrix."""
    if not inputs or any(len(shape) not in (1, 2) for shape in inputs.values()):
        return None
    names = list(inputs)
    matrix = len(next(iter(inputs.values()))) == 2
    if any((len(shape) == 2) != matrix for shape in inputs.values()):
        return None
    tagged = {}
    for index, name in enumerate(names):
        rows = inputs[name][0]
        tags = ((index + 1) << _ROW_BITS) + (torch.arange(rows, dtype=torch.int64) << 2)
        tagged[name] = tags[:, None] + torch.arange(_COLUMNS, dtype=torch.int64) if matrix else tags
    try:
        outputs = transform(tagged)
    except (RuntimeError, ValueError, IndexError):
        return None
    runs = {}
    for name, out in outputs.items():
        found = _runs(out, names, inputs, matrix)
        if found is None:
            return None
        runs[name] = found
    return runs


def _runs(
    out: torch.Tensor, names: list[str], inputs: Mapping[str, tuple[int, ...]], matrix: bool
) -> tuple[RowRun, ...] | None:
    if out.dtype != torch.int64 or out.dim() != (2 if matrix else 1):
        return None
    if matrix:
        if out.shape[1] != _COLUMNS:
            return None
        first = out[:, 0]
        columns = torch.arange(_COLUMNS, dtype=torch.int64)
        if not torch.equal(out, first[:, None] + columns * (first != 0)[:, None]):  # zero rows: all zero
            return None
        tags = first
    else:
        tags = out
    source = tags >> _ROW_BITS
    row = (tags & ((1 << _ROW_BITS) - 1)) >> 2
    if (tags & 3).any() or (source > len(names)).any() or (source < 0).any():
        return None
    limits = torch.tensor([0, *(inputs[n][0] for n in names)], dtype=torch.int64)
    if ((row >= limits[source]) & (source > 0)).any() or ((source == 0) & (row != 0)).any():
        return None
    if len(tags) == 0:
        return ()
    step = torch.ones_like(row)
    step[1:] = (source[1:] != source[:-1]) | ((source[1:] != 0) & (row[1:] != row[:-1] + 1))
    starts = [*torch.nonzero(step).flatten().tolist(), len(tags)]
    found = []
    for start, stop in itertools.pairwise(starts):
        index = int(source[start])
        found.append(RowRun(start, stop - start, names[index - 1] if index else None, int(row[start])))
    return tuple(found)
