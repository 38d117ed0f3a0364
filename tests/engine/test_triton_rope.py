"""The fused rotary-embedding + KV-cache write (`triton_rope`, here in Triton's interpreter on CPU) against
`pointwise.rope` and `attention.write_kv`: fp32 and bf16 (the rotation in float32, rounded once; within one bf16
step, as the interpreter rounds to bf16 differently from torch), an FP8 cache (exactly, on values e4m3 holds, so
that no rounding is involved: the interpreter's float8 rounding loses carries into the exponent; on CUDA also
random values, within one e4m3 step), a group size that is not a power of two and slots scattered over the cache,
the others untouched."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.engine.attention import from_cache, write_kv
from hf_mcore_bridge.engine.pointwise import rope
from hf_mcore_bridge.engine.triton_rope import fused_rope_write

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def _inputs(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int = 16, tokens: int = 5):
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.rand(tokens, head_dim // 2, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
    slots = torch.tensor([3, 17, 0, 40, 9])[:tokens]
    return qkv, cos, sin, slots


def _reference(qkv, cos, sin, slots, heads, kv_heads, cache_dtype, kv_scale):
    """`pointwise.rope` in float32 (rounded once to the activation dtype) and `write_kv` into a fresh cache."""
    tokens, head_dim = qkv.shape[0], cos.shape[1]
    rotated = rope(qkv.float()[:, : (heads + kv_heads) * head_dim].view(tokens, -1, head_dim), cos.float(), sin.float())
    rotated = rotated.to(qkv.dtype)
    q, k = rotated[:, :heads], rotated[:, heads:]
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    cache = torch.zeros(2, 6, 8, kv_heads, head_dim, dtype=cache_dtype)
    write_kv(cache, k, v, slots, kv_scale)
    return q, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 2), (6, 2), (4, 4)])
def test_fused_rope_write_equals_rope_then_write_kv(dtype: torch.dtype, heads: int, kv_heads: int) -> None:
    qkv, cos, sin, slots = _inputs(dtype, heads, kv_heads)
    cache = torch.zeros(2, 6, 8, kv_heads, 16, dtype=dtype, device=DEVICE)
    q = fused_rope_write(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache, slots.to(DEVICE), heads, kv_heads)
    want_q, want_cache = _reference(qkv, cos, sin, slots, heads, kv_heads, dtype, 1.0)
    assert q.shape == (5, heads, 16) and q.dtype == dtype
    tolerance = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(q.cpu(), want_q, rtol=tolerance, atol=1e-6)
    torch.testing.assert_close(cache.cpu(), want_cache, rtol=tolerance, atol=1e-6)  # untouched slots stay zero


def test_fused_rope_write_into_an_fp8_cache_stores_value_over_scale() -> None:
    """Identity rotations (angle 0) of values e4m3 holds times the scale: the stored bytes are `to_cache`'s, one
    key past 448 x scale clamped."""
    heads, kv_heads, scale = 8, 2, 0.5
    qkv, cos, sin, slots = _inputs(torch.bfloat16, heads, kv_heads)
    qkv = (qkv.float().to(E4M3).float() * scale).to(torch.bfloat16)
    qkv[0, heads * 16] = 400.0
    cos, sin = torch.ones_like(cos), torch.zeros_like(sin)
    cache = torch.zeros(2, 6, 8, kv_heads, 16, dtype=E4M3, device=DEVICE)
    fused_rope_write(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache, slots.to(DEVICE), heads, kv_heads, scale)
    _, want = _reference(qkv, cos, sin, slots, heads, kv_heads, E4M3, scale)
    assert torch.equal(cache.cpu().view(torch.uint8), want.view(torch.uint8))
    assert from_cache(cache.cpu(), torch.float32, scale).max().item() == 448 * scale


@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's float8 rounding loses carries into the exponent")
def test_fused_rope_write_rounds_random_values_into_an_fp8_cache_on_cuda() -> None:
    heads, kv_heads, scale = 8, 2, 0.5
    qkv, cos, sin, slots = _inputs(torch.bfloat16, heads, kv_heads)
    cache = torch.zeros(2, 6, 8, kv_heads, 16, dtype=E4M3, device=DEVICE)
    fused_rope_write(qkv.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), cache, slots.to(DEVICE), heads, kv_heads, scale)
    _, want = _reference(qkv, cos, sin, slots, heads, kv_heads, E4M3, scale)
    got, expected = from_cache(cache.cpu(), torch.float32, scale), from_cache(want, torch.float32, scale)
    assert ((got - expected).abs() <= 2**-3 * expected.abs() + 2**-9 * scale).all()
