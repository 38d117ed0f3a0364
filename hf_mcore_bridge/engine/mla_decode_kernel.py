"""The paged multi-latent decode attention kernel's body (Triton), wrapped by `triton_mla`, which documents it.

Kept in a module of its own so that Triton is imported only when the kernel is first used (as
`paged_decode_kernel`).
"""

import triton.language as tl


def mla_decode_kernel(
    q_latent_ptr,
    q_rope_ptr,
    cache_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    stats_ptr,
    scale_log2,
    blocks_per_split,
    num_heads,
    q_latent_stride_b,
    q_latent_stride_h,
    q_rope_stride_b,
    q_rope_stride_h,
    cache_stride_block,
    cache_stride_slot,
    table_stride_b,
    out_stride_b,
    out_stride_h,
    out_stride_s,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    NORMALISE: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    tile: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE
    heads = head_block * HEADS_PAD + tl.arange(0, HEADS_PAD)
    head_ok = heads < num_heads
    dims = tl.arange(0, RANK_PAD)
    dim_ok = dims < RANK
    rope_dims = tl.arange(0, ROPE_PAD)
    rope_ok = rope_dims < ROPE
    offsets = tl.arange(0, tile)

    q_latent = tl.load(
        q_latent_ptr + seq * q_latent_stride_b + heads[:, None] * q_latent_stride_h + dims[None, :],
        mask=head_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    q_rope = tl.load(
        q_rope_ptr + seq * q_rope_stride_b + heads[:, None] * q_rope_stride_h + rope_dims[None, :],
        mask=head_ok[:, None] & rope_ok[None, :],
        other=0.0,
    )
    if DOT_FP32:
        q_latent = q_latent.to(tl.float32)
        q_rope = q_rope.to(tl.float32)
    length = tl.load(lens_ptr + seq).to(tl.int32)
    first = split * blocks_per_split * BLOCK_SIZE
    last = tl.minimum(first + blocks_per_split * BLOCK_SIZE, length)

    running_max = tl.full([HEADS_PAD], float("-inf"), dtype=tl.float32)
    normaliser = tl.zeros([HEADS_PAD], dtype=tl.float32)
    acc = tl.zeros([HEADS_PAD, RANK_PAD], dtype=tl.float32)
    for start in range(first, last, tile):
        position = start + offsets
        valid = position < last
        block = tl.load(tables_ptr + seq * table_stride_b + position // BLOCK_SIZE, mask=valid, other=0)
        row = cache_ptr + block.to(tl.int64) * cache_stride_block + (position % BLOCK_SIZE) * cache_stride_slot
        latent = tl.load(row[:, None] + dims[None, :], mask=valid[:, None] & dim_ok[None, :], other=0.0)
        rope = tl.load(row[:, None] + RANK + rope_dims[None, :], mask=valid[:, None] & rope_ok[None, :], other=0.0)
        latent = latent.to(q_latent.dtype)
        rope = rope.to(q_rope.dtype)
        scores = tl.dot(q_latent, tl.trans(latent), input_precision=PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        normaliser = normaliser * correction + tl.sum(probs, 1)
        probs = probs.to(q_latent_ptr.dtype.element_ty)  # rounded as the activations are, then to the products'
        probs = probs.to(latent.dtype)
        acc = acc * correction[:, None] + tl.dot(probs, latent, input_precision=PRECISION)
        running_max = new_max

    out = out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + split * out_stride_s + dims[None, :]
    mask = head_ok[:, None] & dim_ok[None, :]
    if NORMALISE:
        safe = tl.where(normaliser > 0, normaliser, 1.0)  # a padding row of length 0 reads nothing
        tl.store(out, (acc / safe[:, None]).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out, acc, mask=mask)
        stat = stats_ptr + ((seq * num_heads + heads) * splits + split) * 2
        tl.store(stat, running_max, mask=head_ok)
        tl.store(stat + 1, normaliser, mask=head_ok)
