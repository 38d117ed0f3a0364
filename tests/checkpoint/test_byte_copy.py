"""Byte pieces of stored matrices, and the row tracing that finds them, against torch slicing and hand-written layouts.

A matrix is stored in a file as blocks (row ranges, column ranges, or whole), as safetensors and DCP store
tensors; `row_pieces.region` turns a region into pieces and `byte_copy.write_pieces` writes them. The bytes must be
the region as torch slices it. `row_trace` must find the rows of each output of a fused-tensor transform as the
layout written out in the test says, and refuse transforms that are not row gathers.
"""

from __future__ import annotations

import itertools
import os
import threading
from pathlib import Path

import pytest
import torch
from row_trace import trace

from hf_mcore_bridge.checkpoint.byte_copy import InputFiles, Span, write_pieces
from hf_mcore_bridge.checkpoint.row_pieces import Block, region
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models import tensor_ops
from hf_mcore_bridge.models.row_runs import RowRun


def _store(path: Path, matrix: torch.Tensor, rows: list[int], cols: list[int]) -> list[Block]:
    """`matrix` written to `path` as the blocks of a grid cut at `rows` x `cols` (each block row-major)."""
    blocks, data = [], bytearray(b"header")
    for r0, r1 in itertools.pairwise(rows):
        for c0, c1 in itertools.pairwise(cols):
            blocks.append(Block(path, len(data), r0, r1 - r0, c0, c1 - c0))
            data += matrix[r0:r1, c0:c1].contiguous().view(torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))
    return blocks


def _written(tmp_path: Path, pieces) -> bytes:
    out = tmp_path / "out.bin"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    inputs = InputFiles()
    try:
        end = write_pieces(fd, out, 3, pieces, inputs, threading.Event())
    finally:
        inputs.close()
        os.close(fd)
    data = out.read_bytes()
    assert end == len(data)
    return data[3:]


@pytest.mark.parametrize(
    ("rows", "cols"),
    [([0, 12], [0, 10]), ([0, 5, 12], [0, 10]), ([0, 12], [0, 4, 10]), ([0, 3, 7, 12], [0, 6, 10])],
    ids=["whole", "row-chunks", "column-chunks", "grid"],
)
def test_regions_are_what_torch_slices(tmp_path, rows, cols):
    matrix = torch.randn(12, 10).to(torch.bfloat16)
    blocks = _store(tmp_path / "m.bin", matrix, rows, cols)
    for (a, b), (c0, c1) in [((0, 12), (0, 10)), ((2, 9), (0, 10)), ((1, 11), (3, 8)), ((4, 5), (9, 10))]:
        pieces = region(blocks, (a, b), (c0, c1), 2)
        assert pieces is not None
        expected = matrix[a:b, c0:c1].contiguous().view(torch.uint8).numpy().tobytes()
        assert _written(tmp_path, pieces) == expected, (a, b, c0, c1)
    if len(rows) == 2 and len(cols) == 2:  # one block: whole rows are one contiguous span
        assert region(blocks, (2, 9), (0, 10), 2) == [Span(tmp_path / "m.bin", 6 + 2 * 20, 7 * 20)]


def test_regions_not_covered_are_refused(tmp_path):
    matrix = torch.randn(6, 4)
    blocks = _store(tmp_path / "m.bin", matrix, [0, 3, 6], [0, 4])
    assert region(blocks[:1], (0, 6), (0, 4), 4) is None  # rows 3-5 are in no block
    narrow = [Block(b.path, b.offset, b.row, b.nrows, b.col, 3) for b in blocks]
    assert region(narrow, (0, 6), (0, 4), 4) is None  # column 3 is in no block


def test_reading_past_the_end_of_an_input_is_an_error(tmp_path):
    (tmp_path / "short.bin").write_bytes(b"x" * 10)
    with pytest.raises(CheckpointError, match="truncated"):
        _written(tmp_path, [Span(tmp_path / "short.bin", 4, 20)])


def _reference_qkv_rows(heads: int, groups: int, head_dim: int) -> list[tuple[str, int]]:
    """Megatron's interleaving written out: per group, its q heads' rows, then its k head's, then its v head's."""
    rows = []
    per_group = heads // groups
    for g in range(groups):
        rows += [("q", (g * per_group + h) * head_dim + d) for h in range(per_group) for d in range(head_dim)]
        rows += [("k", g * head_dim + d) for d in range(head_dim)]
        rows += [("v", g * head_dim + d) for d in range(head_dim)]
    return rows


def _expanded(runs: tuple[RowRun, ...]) -> list[tuple[str | None, int]]:
    return [(r.source, r.source_row + i if r.source else 0) for r in runs for i in range(r.count)]


@pytest.mark.parametrize("tail", [(7,), ()], ids=["weight", "bias"])
def test_traced_qkv_rows_follow_megatrons_interleaving(tail):
    heads, groups, head_dim = 6, 2, 4
    shapes = {"q": (heads * head_dim, *tail), "k": (groups * head_dim, *tail), "v": (groups * head_dim, *tail)}
    runs = trace(lambda t: {"qkv": tensor_ops.fuse_qkv(t["q"], t["k"], t["v"], groups)}, shapes)
    assert runs is not None and _expanded(runs["qkv"]) == _reference_qkv_rows(heads, groups, head_dim)
    split = lambda t: dict(zip("qkv", tensor_ops.split_qkv(t["m"], heads, groups, head_dim), strict=True))  # noqa: E731
    back = trace(split, {"m": (40, *tail)})
    reference = _reference_qkv_rows(heads, groups, head_dim)
    for name in "qkv":  # split is the inverse: HF row r of q is the fused row that holds ("q", r)
        fused_rows = sorted((row, i) for i, (src, row) in enumerate(reference) if src == name)
        assert _expanded(back[name]) == [("m", i) for _, i in fused_rows]


def test_traced_padding_is_zero_rows():
    runs = trace(lambda t: {"e": tensor_ops.pad_vocab(t["e"], 12)}, {"e": (9, 5)})
    assert runs == {"e": (RowRun(0, 9, "e", 0), RowRun(9, 3, None, 0))}


@pytest.mark.parametrize(
    "transform",
    [
        lambda t: {"o": t["a"].t().contiguous()},  # columns moved
        lambda t: {"o": t["a"] * 2},  # values computed
        lambda t: {"o": t["a"][:, :2]},  # columns dropped
        lambda t: {"o": t["a"].float()},  # another dtype
        lambda t: {"o": torch.cat((t["a"][:1] + t["a"][1:2], t["a"][2:]))},  # rows summed
    ],
    ids=["transpose", "scale", "narrow", "cast", "sum"],
)
def test_transforms_that_are_not_row_gathers_are_refused(transform):
    assert trace(transform, {"a": (3, 3)}) is None
