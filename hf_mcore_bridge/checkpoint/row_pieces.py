"""The byte pieces of a region of a matrix stored as row-major blocks in files.

A tensor of shape [rows, cols] (a vector is [rows, 1]) may be stored whole (an HF safetensors entry) or as chunks
that tile it (a DCP checkpoint's tensor-parallel chunks: row ranges, or column ranges under row parallelism).
`region` turns rows [a, b) x columns [c0, c1) of it into `byte_copy` pieces: one `Span` per run of whole rows held
by one block, or `Rows` whose parts are the column ranges of the blocks that a row crosses. It returns None when
the blocks do not tile the region, and the caller then reads the tensor instead.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_mcore_bridge.checkpoint.byte_copy import Piece, RowPart, Rows, Span


@dataclass(frozen=True)
class Block:
    """Rows [row, row + nrows) x columns [col, col + ncols) of a matrix, stored row-major from `offset` of `path`."""

    path: Path
    offset: int
    row: int
    nrows: int
    col: int
    ncols: int


def region(blocks: Sequence[Block], rows: tuple[int, int], cols: tuple[int, int], itemsize: int) -> list[Piece] | None:
    """The pieces of rows [a, b) x columns [c0, c1), row by row, or None when `blocks` do not cover it exactly."""
    a, b = rows
    c0, c1 = cols
    cuts = sorted({a, b} | {edge for k in blocks for edge in (k.row, k.row + k.nrows) if a < edge < b})
    pieces: list[Piece] = []
    for lo, hi in itertools.pairwise(cuts):
        crossing = [k for k in blocks if k.row <= lo and hi <= k.row + k.nrows and k.col < c1 and c0 < k.col + k.ncols]
        parts, at = [], c0
        for k in sorted(crossing, key=lambda k: k.col):
            start, end = max(k.col, c0), min(k.col + k.ncols, c1)
            if start != at:
                return None  # a gap, or blocks that overlap
            offset = k.offset + ((lo - k.row) * k.ncols + (start - k.col)) * itemsize
            parts.append(RowPart(k.path, offset, (end - start) * itemsize, k.ncols * itemsize))
            at = end
        if at != c1:
            return None
        if len(parts) == 1 and parts[0].length == parts[0].stride:
            _append_span(pieces, Span(parts[0].path, parts[0].offset, (hi - lo) * parts[0].length))
        else:
            pieces.append(Rows(hi - lo, tuple(parts)))
    return pieces


def _append_span(pieces: list[Piece], span: Span) -> None:
    last = pieces[-1] if pieces else None
    if isinstance(last, Span) and last.path == span.path and last.offset + last.length == span.offset:
        pieces[-1] = Span(span.path, last.offset, last.length + span.length)
    else:
        pieces.append(span)


def joined(pieces: Sequence[Piece]) -> list[Piece]:
    """`pieces` with adjacent spans of contiguous bytes of one file merged into one."""
    out: list[Piece] = []
    for piece in pieces:
        if isinstance(piece, Span):
            _append_span(out, piece)
        else:
            out.append(piece)
    return out
