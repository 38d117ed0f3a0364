"""Row runs: which input tensor and rows each stretch of an output tensor's rows is a copy of, in plain integers.

The byte-copy path of a conversion (`checkpoint.byte_copy`) copies a tensor whose rows are stored unchanged in
the kernel; each table entry type states how its output rows are made of its input rows (`mapping_types`), as
these runs. Nothing here imports torch, so a conversion's copy plan is known before torch is loaded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

MCORE = "mcore"
"""The source name of the megatron-core tensor's rows, in the runs of an export (`Entry.hf_rows`)."""


@dataclass(frozen=True)
class RowRun:
    """Output rows [start, start + count) are input `source`'s rows [source_row, source_row + count); with
    `source` None, they are zeros."""

    start: int
    count: int
    source: str | None
    source_row: int


def merged(segments: Iterable[tuple[str | None, int, int]]) -> tuple[RowRun, ...]:
    """The runs of output rows listed in order as segments (source, first source row, count): empty segments
    dropped and consecutive rows of one source joined, so every run is maximal (zero rows, source None and
    source row 0, join whatever rows they stand for)."""
    runs: list[RowRun] = []
    start = 0
    for source, row, count in segments:
        if count < 0:
            raise ValueError(f"a segment of {count} rows")
        if count == 0:
            continue
        if source is None:
            row = 0
        last = runs[-1] if runs else None
        if last is not None and last.source == source and (source is None or last.source_row + last.count == row):
            runs[-1] = RowRun(last.start, last.count + count, source, last.source_row)
        else:
            runs.append(RowRun(start, count, source, row))
        start += count
    return tuple(runs)
