"""Decode attention kernels against each other and against a dense reference: FlexAttention over the paged cache
(blocks read in place through a block mask) and SDPA over gathered blocks, with shared prompt blocks, partly
filled last blocks, and rows padded with the scratch block as the CUDA-graph buckets pad them."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.engine.attention import DecodeMetadata, decode_attention, with_block_mask
from hf_mcore_bridge.engine.kv_cache import SCRATCH_BLOCK

NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 24, 4, 2, 8, 8


def _dense_reference(q, cache, tables, lengths, scale):
    """Each sequence's keys/values laid out contiguously, grouped heads repeated, softmax in float64."""
    out = []
    for b in range(q.shape[0]):
        slots = torch.cat([torch.arange(blk * BLOCK, blk * BLOCK + BLOCK) for blk in tables[b].tolist()])
        slots = slots[: int(lengths[b])]
        k = cache[0].reshape(-1, KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        v = cache[1].reshape(-1, KV_HEADS, HEAD_DIM)[slots].double().repeat_interleave(HEADS // KV_HEADS, dim=1)
        weights = torch.softmax(torch.einsum("hd,thd->ht", q[b].double(), k) * scale, dim=-1)
        out.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(out).float()


@pytest.mark.parametrize("kernel", ["gather", "flex"])
def test_decode_kernels_match_a_dense_reference(kernel):
    torch.manual_seed(0)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    shared = [3, 7]  # two full prompt blocks shared by the first three sequences, then private blocks
    tables = torch.tensor(
        [
            [*shared, 9, 11, SCRATCH_BLOCK],
            [*shared, 12, SCRATCH_BLOCK, SCRATCH_BLOCK],
            [*shared, 15, 2, 20],
            [5, 6, 8, 10, 13],
            [SCRATCH_BLOCK] * 5,  # a padded row: one scratch token
        ]
    )
    lengths = torch.tensor([14, 9, 20, 17, 1])
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long), block_tables=tables, context_lens=lengths
    )
    if kernel == "flex":
        meta = with_block_mask(meta, BLOCK, NUM_BLOCKS)
    out = decode_attention(q, cache, meta, scale=0.3)
    expected = _dense_reference(q, cache, tables, lengths, 0.3)
    assert out.shape == (len(lengths), HEADS, HEAD_DIM)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_flex_mask_hides_stale_slots_of_the_last_block():
    """Changing a slot past a sequence's length (in its last block, or in a block it does not own) changes
    nothing; changing a slot it reads does."""
    torch.manual_seed(1)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.tensor([[4, 6, 1]])
    meta = with_block_mask(
        DecodeMetadata(
            slot_mapping=torch.zeros(1, dtype=torch.long), block_tables=tables, context_lens=torch.tensor([10])
        ),
        BLOCK,
        NUM_BLOCKS,
    )
    q = torch.randn(1, HEADS, HEAD_DIM)
    before = decode_attention(q, cache, meta, scale=0.3)
    stale = cache.clone()
    stale[:, 1, 2:] += 5.0  # block 1 holds positions 8..11; only 8 and 9 are written
    stale[:, 9] += 5.0  # a block the sequence does not own
    torch.testing.assert_close(decode_attention(q, stale, meta, scale=0.3), before)
    read = cache.clone()
    read[:, 1, 1] += 5.0  # position 9: read
    assert not torch.allclose(decode_attention(q, read, meta, scale=0.3), before)
