"""A decode step's rotary embedding and KV-cache write as one Triton kernel (`fused_rope_write`).

One program per token reads its row of the fused q|k|v projection, rotates its query and key heads (the
`rotate_half` layout of `pointwise.rope`: out = x * cos + cat(-x_hi, x_lo) * sin, in float32, rounded once to
the activation dtype), writes the rotated queries to a fresh `[T, heads, D]` tensor and the rotated keys and the
values straight into the token's cache slot (an FP8 cache: value / kv_scale clamped to +-448 and rounded, as
`attention.to_cache`). It replaces the compiled rotary kernel and the two `index_copy_` kernels of each layer.

Used by the decoder's attention for decode passes through the Triton decode kernel (`DecodeMetadata.triton`) of
models without per-head q/k norms; prefill keeps the separate steps (its attention needs the rotated keys and
values themselves). Head dimensions are powers of two (as the decode kernel's). CPU tensors run in Triton's
interpreter (tests only). Triton itself is imported only when the kernel is first used.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hf_mcore_bridge.engine.attention import FP8_CACHE_DTYPE


@functools.cache
def _kernel() -> Any:
    import triton

    from hf_mcore_bridge.engine.rope_cache_kernel import rope_cache_kernel

    return triton.jit(rope_cache_kernel)


def _pad(n: int) -> int:
    return 1 << (n - 1).bit_length()


def fused_rope_write(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    heads: int,
    kv_heads: int,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """Rotated queries `[T, heads, D]`; the rotated keys and the values stored at `slot_mapping` [T] of
    `layer_cache` [2, NB, BS, kv_heads, D] (contiguous).

    qkv: [T, (heads + 2 kv_heads) D] (last dimension contiguous): q heads, then k heads, then v heads; cos, sin:
    [T, D] in the activation dtype.
    """
    tokens = qkv.shape[0]
    head_dim = layer_cache.shape[-1]
    if qkv.stride(-1) != 1 or not layer_cache.is_contiguous() or head_dim & (head_dim - 1):
        raise ValueError(
            "fused_rope_write needs a contiguous cache, a contiguous last dimension of qkv and a "
            f"power-of-two head_dim (got {head_dim})"
        )
    q = torch.empty(tokens, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    cos, sin = cos.contiguous(), sin.contiguous()
    interpret = qkv.device.type != "cuda"
    _kernel()[(tokens,)](
        qkv,
        cos,
        sin,
        q,
        layer_cache[0],
        layer_cache[1],
        slot_mapping,
        float(kv_scale),
        qkv.stride(0),
        cos.stride(0),
        q.stride(0),
        q.stride(1),
        layer_cache.stride(2),
        layer_cache.stride(3),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HEADS_PAD=_pad(heads),
        KV_HEADS_PAD=_pad(kv_heads),
        HALF=head_dim // 2,
        FP8=layer_cache.dtype == FP8_CACHE_DTYPE,
        **({} if interpret else {"num_warps": 4}),
    )
    return q
