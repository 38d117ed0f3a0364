"""Which input row each output row of a table entry's transform is, found by running the transform on row tags.

The byte-copy path of a conversion (`checkpoint.byte_copy`) copies each output row from the input row that the
entry type declares (`Entry.hf_rows`, `Entry.mcore_rows`). The tests check those declarations against this
independent reading of the entry's own transform: `trace` runs it on small integer tensors whose values name
their input and row (and column), and reads the answer off the result. Each input row is given a few columns,
each tagged with its column number, so a transform that moves columns or computes new values is seen as not a
row gather (None). Zero rows in the output (vocabulary padding) come out as rows of no input.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch

from hf_mcore_bridge.models.row_runs import RowRun

_COLUMNS = 3
_ROW_BITS = 40


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
    with _one_thread():  # small tensors: torch's thread pool costs more than it saves, ten times so on busy cores
        tagged = {}
        for index, name in enumerate(names):
            tags = ((index + 1) << _ROW_BITS) + (torch.arange(inputs[name][0], dtype=torch.int64) << 2)
            tagged[name] = tags[:, None] + torch.arange(_COLUMNS, dtype=torch.int64) if matrix else tags
        try:
            outputs = transform(tagged)
        except (RuntimeError, ValueError, IndexError):
            return None
        limits = np.array([0, *(inputs[n][0] for n in names)], dtype=np.int64)
        runs = {}
        for name, out in outputs.items():
            if not isinstance(out, torch.Tensor) or out.dtype != torch.int64 or out.dim() != (2 if matrix else 1):
                return None
            found = _runs(out.contiguous().numpy(), names, limits)
            if found is None:
                return None
            runs[name] = found
    return runs


@contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _runs(out: np.ndarray, names: list[str], limits: np.ndarray) -> tuple[RowRun, ...] | None:
    """The runs of one traced output (`limits`: 0, then each input's row count)."""
    if out.ndim == 2:
        if out.shape[1] != _COLUMNS:
            return None
        tags = out[:, 0]
        expected = tags[:, None] + np.arange(_COLUMNS, dtype=np.int64) * (tags != 0)[:, None]  # zero rows: all 0
        if not np.array_equal(out, expected):
            return None
    else:
        tags = out
    source = tags >> _ROW_BITS
    row = (tags & ((1 << _ROW_BITS) - 1)) >> 2
    if (tags & 3).any() or (source >= len(limits)).any() or (source < 0).any():
        return None
    if ((source > 0) & (row >= limits[source])).any() or ((source == 0) & (row != 0)).any():
        return None
    if len(tags) == 0:
        return ()
    step = np.ones(len(tags), dtype=bool)
    step[1:] = (source[1:] != source[:-1]) | ((source[1:] != 0) & (row[1:] != row[:-1] + 1))
    starts = [*np.flatnonzero(step).tolist(), len(tags)]
    found = []
    for start, stop in itertools.pairwise(starts):
        index = int(source[start])
        found.append(RowRun(start, stop - start, names[index - 1] if index else None, int(row[start])))
    return tuple(found)
