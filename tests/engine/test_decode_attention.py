"""Decode attention kernels against a dense reference: the Triton kernel (here in Triton's interpreter), FlexAttention
over the paged cache (blocks read in place through a block mask) and SDPA over gathered blocks, with shared prompt
blocks, partly filled last blocks, and rows padded with the scratch block as the CUDA-graph buckets pad them; the
Triton kernel also split over the KV length, in bf16, and with the strided queries the decoder hands it; an FP8
cache written, copied and read (Triton and gather) against a reference over its dequantized entries."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from hf_mcore_bridge.engine import triton_decode
from hf_mcore_bridge.engine.attention import (
    DecodeMetadata,
    copy_blocks,
    decode_attention,
    from_cache,
    to_cache,
    with_block_mask,
    write_kv,
)
from hf_mcore_bridge.engine.kv_cache import SCRATCH_BLOCK
from hf_mcore_bridge.engine.triton_decode import num_splits, paged_decode_attention, tile_blocks

NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, HEADS = 24, 4, 2, 16, 8
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton kernel runs: compiled on a GPU, else in Triton's interpreter (see conftest)."""


def _dense_reference(q, cache, tables, lengths, scale, window=None, sinks=None):
    """Each sequence's keys/values laid out contiguously, grouped heads repeated, softmax in float64; only the last
    `window` keys, and a sink logit per head in every denominator (as transformers' GPT-OSS attention)."""
    out = []
    block, kv_heads, head_dim = cache.shape[2:]
    group = q.shape[1] // kv_heads
    for b in range(q.shape[0]):
        slots = torch.cat([torch.arange(blk * block, blk * block + block) for blk in tables[b].tolist()])
        slots = slots[: int(lengths[b])]
        if window is not None:
            slots = slots[-window:]
        k = cache[0].reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        v = cache[1].reshape(-1, kv_heads, head_dim)[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None]), dim=-1)
        weights = torch.softmax(scores, dim=-1)[:, : len(slots)]
        out.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(out).float()


@pytest.mark.parametrize("kernel", ["gather", "flex", "triton"])
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
    if kernel == "triton":
        meta = replace(meta, block_tables=tables.to(TRITON_DEVICE), context_lens=lengths.to(TRITON_DEVICE), triton=True)
        q, cache = q.to(TRITON_DEVICE), cache.to(TRITON_DEVICE)
    out = decode_attention(q, cache, meta, scale=0.3).cpu()
    q, cache = q.cpu(), cache.cpu()
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (4, 4), (6, 2)])
@pytest.mark.parametrize("splits", [1, 2, 3, 7])
def test_triton_kernel_splits_groups_and_dtypes(splits, heads, kv_heads, dtype):
    """Split-KV ranges (including ranges past a short sequence's end), grouped and plain heads, a group size that
    is not a power of two, bf16 and fp32; queries strided like the decoder's (a view into a wider projection); a
    row of length 0 (nothing to read) gives zeros."""
    torch.manual_seed(2)
    block, head_dim, n_blocks = 8, 16, 7
    cache = torch.randn(2, 40, block, kv_heads, head_dim).to(dtype)
    lengths = torch.tensor([1, block, block + 1, 3 * block, n_blocks * block, 0])
    tables = torch.stack([torch.randperm(39)[:n_blocks] + 1 for _ in lengths])
    q = torch.randn(len(lengths), heads + 2 * kv_heads, head_dim).to(dtype)[:, :heads]
    on = TRITON_DEVICE
    out = paged_decode_attention(q.to(on), cache.to(on), tables.to(on), lengths.to(on), 0.25, splits=splits).cpu()
    assert out.dtype == dtype and out.shape == (len(lengths), heads, head_dim)
    expected = _dense_reference(q[:-1], cache, tables[:-1], lengths[:-1], 0.25)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: probabilities and output rounded to bf16
    torch.testing.assert_close(out[:-1].float(), expected, atol=tolerance, rtol=tolerance)
    assert torch.equal(out[-1].float(), torch.zeros(heads, head_dim))


def test_triton_kernel_reads_only_the_sequences_slots():
    """Slots past a sequence's length, and blocks outside its table, are never read: poisoning them with NaN
    changes nothing (a masked read of a NaN would spread)."""
    torch.manual_seed(3)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.tensor([[4, 6, 1, SCRATCH_BLOCK]])
    lengths = torch.tensor([10])
    q = torch.randn(1, HEADS, HEAD_DIM)
    q, cache, tables, lengths = (t.to(TRITON_DEVICE) for t in (q, cache, tables, lengths))
    before = paged_decode_attention(q, cache, tables, lengths, scale=0.3, splits=1)
    poisoned = cache.clone()
    poisoned[:, 1, 2:] = float("nan")  # the last block holds positions 8..11; only 8 and 9 are written
    poisoned[:, 9] = float("nan")  # a block the sequence does not own
    poisoned[:, SCRATCH_BLOCK] = float("nan")  # its table's next entry, past its length
    for splits in (1, 2, 4):
        torch.testing.assert_close(paged_decode_attention(q, poisoned, tables, lengths, 0.3, splits=splits), before)


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("window", [None, 1, 5, 9])
@pytest.mark.parametrize(("kernel", "splits"), [("gather", None), ("triton", 1), ("triton", 3)])
def test_sliding_windows_and_sinks_match_a_dense_reference(kernel, splits, window, sinks):
    """A layer's sliding window (only the last `window` keys: shorter, longer than and crossing blocks) and a sink
    logit per head (GPT-OSS), through `gather` and the Triton kernel (split over the window's blocks: the sink
    counted once); sequences shorter than the window and a padded row of length 0 (zeros) included."""
    torch.manual_seed(5)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.stack([torch.randperm(NUM_BLOCKS - 1)[:6] + 1 for _ in range(4)])
    lengths = torch.tensor([3, 13, 24, 0])
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    sink_logits = torch.randn(HEADS) if sinks else None
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long), block_tables=tables, context_lens=lengths
    )
    on = TRITON_DEVICE if kernel == "triton" else "cpu"
    if kernel == "triton":
        out = paged_decode_attention(
            q.to(on),
            cache.to(on),
            tables.to(on),
            lengths.to(on),
            0.3,
            splits=splits,
            window=window,
            sinks=None if sink_logits is None else sink_logits.to(on),
        ).cpu()
    else:
        out = decode_attention(q, cache, meta, 0.3, window=window, sinks=sink_logits)
    expected = _dense_reference(q[:-1], cache, tables[:-1], lengths[:-1], 0.3, window, sink_logits)
    torch.testing.assert_close(out[:-1], expected, atol=1e-5, rtol=1e-5)
    if kernel == "triton":
        assert torch.equal(out[-1], torch.zeros(HEADS, HEAD_DIM))


def test_triton_kernel_reads_only_the_windows_blocks():
    """With a window, the blocks wholly before it are never read (NaN there changes nothing), the block holding
    its first position is; FlexAttention refuses windows and sinks."""
    torch.manual_seed(6)
    cache = torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM)
    tables = torch.tensor([[4, 6, 1, 9, 12]])  # 18 tokens: window 7 covers positions 11..17, blocks 1, 9, 12
    lengths = torch.tensor([18])
    q = torch.randn(1, HEADS, HEAD_DIM)
    q, cache, tables, lengths = (t.to(TRITON_DEVICE) for t in (q, cache, tables, lengths))
    before = paged_decode_attention(q, cache, tables, lengths, 0.3, window=7)
    poisoned = cache.clone()
    poisoned[:, 4] = float("nan")
    poisoned[:, 6] = float("nan")
    poisoned[:, 1, :3] = float("nan")  # positions 8..10 of the window's first block: masked, though read
    for splits in (1, 2, 3):
        torch.testing.assert_close(paged_decode_attention(q, poisoned, tables, lengths, 0.3, splits, window=7), before)
    poisoned[:, 1, 3] = float("nan")  # position 11: inside the window
    assert paged_decode_attention(q, poisoned, tables, lengths, 0.3, window=7).isnan().all()
    meta = with_block_mask(
        DecodeMetadata(slot_mapping=torch.zeros(1, dtype=torch.long), block_tables=tables, context_lens=lengths),
        BLOCK,
        NUM_BLOCKS,
    )
    with pytest.raises(ValueError, match="no sliding window or attention sinks"):
        decode_attention(q.cpu(), cache.cpu(), meta, 0.3, window=7)


def test_split_count_fills_the_gpu_only_when_the_batch_does_not():
    assert num_splits(batch=512, kv_heads=8, n_blocks=64, sm_count=132) == 1  # 4096 programs already
    assert num_splits(batch=33, kv_heads=8, n_blocks=64, sm_count=132) == 1  # two per SM
    assert num_splits(batch=4, kv_heads=8, n_blocks=512, sm_count=132) == 17  # 32 programs -> ~4 per SM
    assert num_splits(batch=4, kv_heads=8, n_blocks=12, sm_count=132) == 3  # at least 4 blocks per split
    assert num_splits(batch=1, kv_heads=1, n_blocks=2, sm_count=132) == 1


def test_tiles_are_longer_for_long_ranges_and_wide_enough_for_the_product():
    assert tile_blocks(block_size=32, blocks_per_split=2) == 2  # 64 tokens
    assert tile_blocks(block_size=32, blocks_per_split=16) == 4  # 512 tokens to read: 128-token tiles
    assert tile_blocks(block_size=16, blocks_per_split=4) == 4
    assert tile_blocks(block_size=256, blocks_per_split=1) == 1
    assert tile_blocks(block_size=4, blocks_per_split=1) == 16


def test_triton_kernel_refuses_head_dims_it_cannot_take(monkeypatch):
    """The head-dim check on any machine: the tensors live where the kernel would run (a CUDA device, else the CPU
    under the interpreter), and Triton counts as installed, so only the head dimension (8 < 16) or the block size
    (3, not a power of two) can be refused; both are checked before Triton is imported."""
    monkeypatch.setattr(triton_decode, "available", lambda: True)
    if TRITON_DEVICE == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    tables, lengths = torch.zeros(1, 1, dtype=torch.long), torch.ones(1)
    for head_dim, block_size in ((8, 4), (16, 3)):
        q = torch.zeros(1, 4, head_dim, device=TRITON_DEVICE)
        cache = torch.zeros(2, 3, block_size, 2, head_dim, device=TRITON_DEVICE)
        with pytest.raises(ValueError, match="power-of-two head_dim >= 16"):
            paged_decode_attention(q, cache, tables.to(TRITON_DEVICE), lengths.to(TRITON_DEVICE), 1.0)


E4M3 = torch.float8_e4m3fn


def test_fp8_cache_write_and_block_copy_store_the_rounded_scaled_values():
    """`write_kv` into an FP8 cache stores value / scale rounded to e4m3 and clamped to +-448 (the reference: torch's
    own float32 -> e4m3 conversion, written here); `copy_blocks` copies those bytes."""
    torch.manual_seed(5)
    cache = torch.zeros(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=E4M3)
    k, v = torch.randn(3, KV_HEADS, HEAD_DIM), torch.randn(3, KV_HEADS, HEAD_DIM)
    k[0, 0, 0], v[1, 1, 1] = 1000.0, -1000.0  # past 448 * 0.5: clamped
    slots = torch.tensor([5, 9, 30])
    write_kv(cache, k, v, slots, kv_scale=0.5)
    for index, x in enumerate((k, v)):
        stored = cache[index].view(-1, KV_HEADS, HEAD_DIM)[slots]
        want = (x / 0.5).clamp(-448, 448).to(E4M3)
        assert torch.equal(stored.view(torch.uint8), want.view(torch.uint8))
    assert cache[0].view(-1, KV_HEADS, HEAD_DIM)[5, 0, 0].float() == 448.0
    assert cache[0].view(-1, KV_HEADS, HEAD_DIM)[0].float().abs().sum() == 0  # other slots untouched
    copy_blocks(cache[None], torch.tensor([2]), torch.tensor([11]))  # slots 8..11 (slot 9 written) onto block 11
    assert torch.equal(cache[:, 11].view(torch.uint8), cache[:, 2].view(torch.uint8))
    assert torch.equal(from_cache(cache[:, 2], torch.float32, 0.5), cache[:, 2].float() * 0.5)


@pytest.mark.parametrize("kernel", ["gather", "triton"])
def test_fp8_cache_decode_matches_a_reference_over_its_dequantized_entries(kernel):
    torch.manual_seed(6)
    scale = 0.25
    cache = to_cache(torch.randn(2, NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM), E4M3, scale)
    tables = torch.tensor([[3, 7, 9, 11, 2], [3, 7, 12, SCRATCH_BLOCK, SCRATCH_BLOCK], [5, 6, 8, 10, 13]])
    lengths = torch.tensor([18, 9, 20])
    q = torch.randn(len(lengths), HEADS, HEAD_DIM)
    on = TRITON_DEVICE if kernel == "triton" else "cpu"
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(len(lengths), dtype=torch.long, device=on),
        block_tables=tables.to(on),
        context_lens=lengths.to(on),
        triton=kernel == "triton",
        kv_scale=scale,
    )
    out = decode_attention(q.to(on), cache.to(on), meta, scale=0.3).cpu()
    expected = _dense_reference(q, from_cache(cache, torch.float32, scale), tables, lengths, 0.3)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the scale matters: read as if unscaled, the output is not the reference's
    unscaled = decode_attention(q.to(on), cache.to(on), replace(meta, kv_scale=1.0), scale=0.3).cpu()
    assert not torch.allclose(unscaled, expected, atol=1e-2)
