"""Per-block FP8 (e4m3) weights for the rollout engine: quantize, dequantize, and the FP8 linear map.

Weights are 128 x 128 blocks of e4m3 with a float32 `scale_inv` each (`convert.fp8_blocks`, which checkpoint
conversion shares; re-exported here). Activations, for the CUDA FP8 GEMM, are quantized the same way per 1 x 128
group of each row (DeepSeek's and NeMo-RL's blockwise FP8 recipe).

`fp8_linear` is `x @ dequantize(q, scale_inv).T + bias`. On CUDA it goes through `torch.nn.functional.scaled_mm`
(128 x 128 weight blocks, 1 x 128 activation groups) where `scaled_mm_works(device)` found that GEMM present and
agreeing with the dequantized matmul; elsewhere (CPU, GPUs or torch builds without blockwise scaling, shapes not
multiples of 128) the weight is dequantized to the activations' dtype and multiplied: the same numbers up to the
activations' own rounding, without FP8's speed.

Assumes 2-D weights (linear layers); embeddings, norms and the output layer stay in the engine's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_mcore_bridge.convert.fp8_blocks import BLOCK, E4M3_MAX, FP8_DTYPE, dequantize_blockwise, quantize_blockwise

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8_DTYPE",
    "dequantize_blockwise",
    "fp8_linear",
    "gemm_agrees",
    "quantize_activations",
    "quantize_blockwise",
    "scaled_mm_works",
]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, K]` with K a multiple of 128 -> `(q: [M, K] FP8, scale_inv: [M, K/128] float32)`, per 1 x 128 group."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1)
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (groups / scale_inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(m, k).to(FP8_DTYPE)
    return q, scale_inv


def _scaled_mm(x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """`x: [M, K]` times `q.T` through the blockwise FP8 GEMM (CUDA), output in `x.dtype`."""
    xq, x_scale = quantize_activations(x)
    return F.scaled_mm(
        xq,
        q.t(),
        # cuBLAS wants the 1 x 128 activation scales outer-dim-major (M contiguous)
        x_scale.t().contiguous().t(),
        F.ScalingType.BlockWise1x128,
        scale_inv,
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )


@functools.cache
def scaled_mm_works(device: torch.device) -> bool:
    """Whether the blockwise FP8 GEMM runs on `device` and agrees with the dequantized matmul (`gemm_agrees`).
    CPU: False without trying."""
    return device.type == "cuda" and gemm_agrees(device, _scaled_mm)


def gemm_agrees(device: torch.device, gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> bool:
    """Whether `gemm(x, q, scale_inv)` runs on a random 256 x 384 x 256 product on `device` and agrees with
    `x @ dequantize(q, scale_inv).T` in float32 to 5% relative error (FP8 activation rounding is ~3%)."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 384, device=device, generator=generator).to(torch.bfloat16)
    q, scale_inv = quantize_blockwise(torch.randn(256, 384, device=device, generator=generator) * 0.05)
    expected = x.float() @ dequantize_blockwise(q, scale_inv, torch.float32).t()
    try:
        got = gemm(x, q, scale_inv).float()
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError):  # AttributeError: no F.scaled_mm
        return False
    return got.shape == expected.shape and bool(((got - expected).norm() / expected.norm()) < 0.05)


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`x: [..., K]` -> `[..., N]`: `x @ dequantize(q, scale_inv).T + bias` in `x.dtype` (see the module
    docstring for when the FP8 GEMM runs)."""
    n, k = q.shape
    flat = x.reshape(-1, k)
    # cuBLAS's blockwise FP8 GEMM wants every dimension 16-aligned (N and K are 128-aligned here)
    if n % BLOCK == 0 and k % BLOCK == 0 and flat.shape[0] % 16 == 0 and flat.shape[0] and scaled_mm_works(x.device):
        out = _scaled_mm(flat, q, scale_inv)
        out = out if bias is None else out + bias
    else:
        out = F.linear(flat, dequantize_blockwise(q, scale_inv, x.dtype), bias)
    return out.reshape(*x.shape[:-1], n)
