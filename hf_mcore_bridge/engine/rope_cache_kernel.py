"""The fused rotary-embedding and KV-cache-write kernel's body (Triton), wrapped by `triton_rope`, which documents
it.

Kept in a module of its own so that Triton is imported only when the kernel is first used (as
`paged_decode_kernel`).
"""

import triton.language as tl


def rope_cache_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slots_ptr,
    kv_scale,
    qkv_stride,
    table_stride,
    q_stride_t,
    q_stride_h,
    cache_stride_slot,
    cache_stride_head,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    KV_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr,
    FP8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, HALF)
    row = qkv_ptr + token * qkv_stride
    cos_lo = tl.load(cos_ptr + token * table_stride + dims).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * table_stride + HALF + dims).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * table_stride + dims).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * table_stride + HALF + dims).to(tl.float32)

    # queries: rotated (`rotate_half` layout: out = x * cos + cat(-x_hi, x_lo) * sin), written to q
    heads = tl.arange(0, HEADS_PAD)
    ok = (heads < HEADS)[:, None]
    at = row + heads[:, None] * (2 * HALF) + dims[None, :]
    lo = tl.load(at, mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)
    out = q_ptr + token * q_stride_t + heads[:, None] * q_stride_h + dims[None, :]
    tl.store(out, (lo * cos_lo[None, :] - hi * sin_lo[None, :]).to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(out + HALF, (hi * cos_hi[None, :] + lo * sin_hi[None, :]).to(q_ptr.dtype.element_ty), mask=ok)

    # keys rotated, values as they are, into the token's cache slot
    slot = tl.load(slots_ptr + token).to(tl.int64)
    kv = tl.arange(0, KV_HEADS_PAD)
    kv_ok = (kv < KV_HEADS)[:, None]
    at = row + (HEADS + kv[:, None]) * (2 * HALF) + dims[None, :]
    lo = tl.load(at, mask=kv_ok, other=0.0).to(tl.float32)
    hi = tl.load(at + HALF, mask=kv_ok, other=0.0).to(tl.float32)
    k_lo = (lo * cos_lo[None, :] - hi * sin_lo[None, :]).to(q_ptr.dtype.element_ty).to(tl.float32)
    k_hi = (hi * cos_hi[None, :] + lo * sin_hi[None, :]).to(q_ptr.dtype.element_ty).to(tl.float32)
    at = row + (HEADS + KV_HEADS + kv[:, None]) * (2 * HALF) + dims[None, :]
    v_lo = tl.load(at, mask=kv_ok, other=0.0).to(tl.float32)
    v_hi = tl.load(at + HALF, mask=kv_ok, other=0.0).to(tl.float32)
    if FP8:  # as `attention.to_cache`: value / scale, clamped to the e4m3 range
        k_lo = tl.clamp(k_lo / kv_scale, -448.0, 448.0)
        k_hi = tl.clamp(k_hi / kv_scale, -448.0, 448.0)
        v_lo = tl.clamp(v_lo / kv_scale, -448.0, 448.0)
        v_hi = tl.clamp(v_hi / kv_scale, -448.0, 448.0)
    place = slot * cache_stride_slot + kv[:, None] * cache_stride_head + dims[None, :]
    kind = k_cache_ptr.dtype.element_ty
    tl.store(k_cache_ptr + place, k_lo.to(kind), mask=kv_ok)
    tl.store(k_cache_ptr + place + HALF, k_hi.to(kind), mask=kv_ok)
    tl.store(v_cache_ptr + place, v_lo.to(kind), mask=kv_ok)
    tl.store(v_cache_ptr + place + HALF, v_hi.to(kind), mask=kv_ok)
