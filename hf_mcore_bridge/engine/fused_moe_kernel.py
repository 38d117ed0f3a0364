"""The grouped expert GEMM's body (Triton), wrapped by `fused_moe`, which documents it.

Kept in a module of its own so that Triton is imported only when the kernel is first used (as
`paged_decode_kernel`): `triton.jit` reads the function's source and its `tl.constexpr` annotations.

One program computes one tile of `BLOCK_M` expert-sorted rows by `BLOCK_N` output columns. Its rows all belong to
one expert (`block_expert`, -1: a block past the last expert's padded rows, which does nothing); each row is a
(token, k) pair index into the flat [T * k] routing (`sorted_pairs`; the value `num_pairs` marks a padding row,
neither read nor written). The A row a pair reads is `pair // A_DIV` (the token, for the gate/up product; the pair
itself, for the down product); the output row it writes is the pair.
"""

import triton.language as tl


def fused_moe_kernel(
    a_ptr,
    b_ptr,
    bias_ptr,
    out_ptr,
    weights_ptr,
    sorted_pairs_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    limit,
    alpha,
    stride_am,
    stride_be,
    stride_bn,
    stride_bk,
    stride_bias_e,
    stride_om,
    A_DIV: tl.constexpr,
    GATED: tl.constexpr,
    CLAMPED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_expert_ptr + block).to(tl.int64)
    if expert < 0:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_pairs_ptr + rows).to(tl.int64)
    row_ok = pairs < num_pairs
    a_rows = tl.where(row_ok, pairs // A_DIV, 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    depth = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None] * stride_am
    b_base = b_ptr + expert * stride_be + cols[None, :].to(tl.int64) * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        ks = start + depth
        k_ok = ks < K
        a = tl.load(a_base + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if EVEN_K and EVEN_N:  # no mask on the weights: their loads vectorize fully
            b = tl.load(b_base + ks[:, None] * stride_bk)
        else:
            b_mask = k_ok[:, None] & col_ok[None, :]
            b = tl.load(b_base + ks[:, None] * stride_bk, mask=b_mask, other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc += tl.dot(a, b, input_precision=PRECISION)
        if GATED:  # the up rows sit N rows after the gate rows of the same expert
            up_base = b_base + N * stride_bn + ks[:, None] * stride_bk
            if EVEN_K and EVEN_N:
                b_up = tl.load(up_base)
            else:
                b_up = tl.load(up_base, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if DOT_FP32:
                b_up = b_up.to(tl.float32)
            acc_up += tl.dot(a, b_up, input_precision=PRECISION)
    if HAS_BIAS:
        bias = bias_ptr + expert * stride_bias_e + cols
        acc += tl.load(bias, mask=col_ok, other=0.0).to(tl.float32)
        if GATED:
            acc_up += tl.load(bias + N, mask=col_ok, other=0.0).to(tl.float32)
    if GATED:
        if CLAMPED:  # GPT-OSS: (clamp(up, -l, l) + 1) * g * sigmoid(alpha * g), g = min(gate, l)
            gate = tl.minimum(acc, limit)
            up = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = (up + 1.0) * (gate * tl.sigmoid(gate * alpha))
        else:  # silu(gate) * up
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    out = out_ptr + pairs[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
