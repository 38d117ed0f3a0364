"""The pure tensor transforms, checked against layouts built independently, head by head."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.tensor_ops import (
    fuse_gate_up,
    fuse_qkv,
    global_shape,
    merge_rank_shards,
    pad_vocab,
    padded_vocab_size,
    rank_shard,
    shard_boxes,
    split_gate_up,
    split_qkv,
    take_box,
    unpad_vocab,
)


def _reference_interleave(q, k, v, heads, groups, head_dim):
    """megatron's layout written out head by head: for each group, its q heads, then its k head, its v head."""
    rows = []
    per_group = heads // groups
    for g in range(groups):
        for h in range(g * per_group, (g + 1) * per_group):
            rows.append(q[h * head_dim : (h + 1) * head_dim])
        rows.append(k[g * head_dim : (g + 1) * head_dim])
        rows.append(v[g * head_dim : (g + 1) * head_dim])
    return torch.cat(rows)


@pytest.mark.parametrize(("heads", "groups", "head_dim"), [(4, 2, 8), (8, 8, 4), (6, 1, 2), (32, 8, 16)])
@pytest.mark.parametrize("with_hidden", [True, False], ids=["weight", "bias"])
def test_fuse_qkv_matches_per_group_interleave_and_splits_back(heads, groups, head_dim, with_hidden):
    tail = (5,) if with_hidden else ()
    q = torch.randn(heads * head_dim, *tail)
    k = torch.randn(groups * head_dim, *tail)
    v = torch.randn(groups * head_dim, *tail)
    fused = fuse_qkv(q, k, v, groups)
    assert torch.equal(fused, _reference_interleave(q, k, v, heads, groups, head_dim))
    q2, k2, v2 = split_qkv(fused, heads, groups, head_dim)
    assert torch.equal(q2, q) and torch.equal(k2, k) and torch.equal(v2, v)


def test_gate_up_is_concatenation():
    gate, up = torch.randn(6, 3), torch.randn(6, 3)
    fused = fuse_gate_up(gate, up)
    assert torch.equal(fused[:6], gate) and torch.equal(fused[6:], up)
    g2, u2 = split_gate_up(fused)
    assert torch.equal(g2, gate) and torch.equal(u2, up)


def test_vocab_padding_rule_and_zero_rows():
    assert padded_vocab_size(211, 128, 1) == 256
    assert padded_vocab_size(211, 128, 4) == 512
    assert padded_vocab_size(128256, 128, 1) == 128256
    assert padded_vocab_size(128256, 128, 8) == 129024
    assert padded_vocab_size(151936, 128, 2) == 152064
    weight = torch.randn(211, 4)
    padded = pad_vocab(weight, 256)
    assert padded.shape == (256, 4) and torch.equal(padded[:211], weight) and not padded[211:].any()
    assert torch.equal(unpad_vocab(padded, 211), weight)
    with pytest.raises(ValueError, match="smaller"):
        pad_vocab(weight, 200)


def test_shard_boxes_cover_each_style():
    assert shard_boxes((8, 4), Parallel.COLUMN, 2) == [((0, 0), (4, 4)), ((4, 0), (4, 4))]
    assert shard_boxes((8, 4), Parallel.ROW, 2) == [((0, 0), (8, 2)), ((0, 2), (8, 2))]
    assert shard_boxes((8,), Parallel.REPLICATED, 4) == [((0,), (8,))]
    # each rank holds [gate_r; up_r]: gate rows 0-1 and up rows 4-5 for rank 0
    assert shard_boxes((8, 4), Parallel.GATED_COLUMN, 2) == [
        ((0, 0), (2, 4)),
        ((2, 0), (2, 4)),
        ((4, 0), (2, 4)),
        ((6, 0), (2, 4)),
    ]
    tensor = torch.arange(32).reshape(8, 4)
    chunks = [take_box(tensor, box) for box in shard_boxes((8, 4), Parallel.ROW, 4)]
    assert torch.equal(torch.cat(chunks, dim=1), tensor)
    with pytest.raises(ValueError, match="does not split"):
        shard_boxes((6, 4), Parallel.COLUMN, 4)


@pytest.mark.parametrize("parallel", [p for p in Parallel if p is not Parallel.COLUMN_PARTS])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_shards_merge_back(parallel, tp):
    full = torch.randn(16, 8)
    shards = [rank_shard(full, parallel, tp, r) for r in range(tp)]
    for shard in shards:
        assert global_shape(tuple(shard.shape), parallel, tp) == (16, 8)
    assert torch.equal(merge_rank_shards(shards, parallel), full)


def test_a_tensor_saved_in_parts_is_not_split_without_them():
    assert len(shard_boxes((6, 4), Parallel.COLUMN_PARTS, 1)) == 1
    with pytest.raises(ValueError, match="split part by part"):
        shard_boxes((6, 4), Parallel.COLUMN_PARTS, 2)
    with pytest.raises(ValueError, match="has 5 rows, not 6"):
        shard_boxes((6, 4), Parallel.COLUMN_PARTS, 2, parts=(2, 3))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_tensor_of_parts_splits_part_by_part(tp):
    full = torch.randn(16, 8)
    parts = (4, 8, 4)
    for rank in range(tp):  # megatron-core's GatedDeltaNet: each rank holds its rows of each part, part after part
        expected = torch.cat([part.chunk(tp)[rank] for part in full.split(parts)])
        assert torch.equal(rank_shard(full, Parallel.COLUMN_PARTS, tp, rank, parts), expected)
    shards = [rank_shard(full, Parallel.COLUMN_PARTS, tp, r, parts) for r in range(tp)]
    assert global_shape(tuple(shards[0].shape), Parallel.COLUMN_PARTS, tp) == (16, 8)
    assert torch.equal(merge_rank_shards(shards, Parallel.COLUMN_PARTS, parts), full)


def test_gated_rank_shard_is_gate_then_up():
    full = torch.arange(8.0)[:, None].expand(8, 2)  # rows 0-3 gate, 4-7 up
    assert rank_shard(full, Parallel.GATED_COLUMN, 2, 1)[:, 0].tolist() == [2.0, 3.0, 6.0, 7.0]
