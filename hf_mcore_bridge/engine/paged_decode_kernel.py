"""The paged decode attention kernel's body (Triton), wrapped by `triton_decode`, which documents it.

Kept in a module of its own so that Triton is imported only when the kernel is first used: `triton.jit` reads the
function's source and its `tl.constexpr` annotations, and `triton_decode` wraps it on first use (compiled on
CUDA, or run by Triton's interpreter where TRITON_INTERPRET=1 was set before Triton was imported).
"""

import triton.language as tl


def paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    stats_ptr,
    sinks_ptr,
    window,
    scale_log2,
    value_scale,
    blocks_per_split,
    q_stride_b,
    q_stride_h,
    cache_stride_block,
    cache_stride_slot,
    cache_stride_head,
    table_stride_b,
    out_stride_b,
    out_stride_h,
    out_stride_s,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_BLOCKS: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
    NORMALISE: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    tile: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE
    rows = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    offsets = tl.arange(0, tile)
    heads = kv_head * GROUP + rows
    row_ok = rows < GROUP

    q = tl.load(q_ptr + seq * q_stride_b + heads[:, None] * q_stride_h + dims[None, :], mask=row_ok[:, None], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    dtype = q.dtype  # of the products: an FP8 cache's tiles are converted to it
    length = tl.load(lens_ptr + seq).to(tl.int32)
    # the window's first position; the splits share out the blocks from the one holding it
    lower = tl.maximum(length - window, 0)
    first = (lower // BLOCK_SIZE + split * blocks_per_split) * BLOCK_SIZE
    last = tl.minimum(first + blocks_per_split * BLOCK_SIZE, length)
    first = tl.maximum(first, lower)

    running_max = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    normaliser = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if HAS_SINKS:  # noqa: SIM102 (a compile-time branch around a run-time one) the sink joins the first split
        if split == 0:
            sink = tl.load(sinks_ptr + heads, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            running_max = tl.where(row_ok, sink, running_max)
            normaliser = tl.where(row_ok, 1.0, normaliser)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for start in range(first, last, tile):
        position = start + offsets
        valid = position < last
        block = tl.load(tables_ptr + seq * table_stride_b + position // BLOCK_SIZE, mask=valid, other=0)
        row = block.to(tl.int64) * cache_stride_block + (position % BLOCK_SIZE) * cache_stride_slot
        row += kv_head * cache_stride_head
        keys = tl.load(k_ptr + row[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        values = tl.load(v_ptr + row[:, None] + dims[None, :], mask=valid[:, None], other=0.0)
        keys = keys.to(dtype)
        scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        normaliser = normaliser * correction + tl.sum(probs, 1)
        probs = probs.to(q_ptr.dtype.element_ty)  # rounded as the activations are, then to the products' dtype
        probs = probs.to(dtype)
        values = values.to(dtype)
        acc = acc * correction[:, None] + tl.dot(probs, values, input_precision=PRECISION)
        running_max = new_max

    acc = acc * value_scale
    out = out_ptr + seq * out_stride_b + heads[:, None] * out_stride_h + split * out_stride_s + dims[None, :]
    if NORMALISE:
        safe = tl.where(normaliser > 0, normaliser, 1.0)  # a padding row of length 0 reads nothing
        tl.store(out, (acc / safe[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        tl.store(out, acc, mask=row_ok[:, None])
        stat = stats_ptr + ((seq * tl.num_programs(1) * GROUP + heads) * splits + split) * 2
        tl.store(stat, running_max, mask=row_ok)
        tl.store(stat + 1, normaliser, mask=row_ok)
