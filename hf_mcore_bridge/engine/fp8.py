"""Per-block FP8 (e4m3) weights for the rollout engine: quantize, dequantize, and the FP8 linear map.

Weights are 128 x 128 blocks of e4m3 with a float32 `scale_inv` each (`checkpoint.fp8_blocks`, which checkpoint
conversion shares; re-exported here). Activations, for the CUDA FP8 GEMM, are quantized the same way per 1 x 128
group of each row (DeepSeek's and NeMo-RL's blockwise FP8 recipe).

`fp8_linear` is `x @ dequantize(q, scale_inv).T + bias`. On CUDA it goes through `torch.nn.functional.scaled_mm`
(`BlockWise1x128` activations, `BlockWise128x128` weights: DeepSeek's recipe, cuBLASLt >= 12.9 on SM 9.0) where
`scaled_mm_works(device)` found that GEMM present and agreeing with the dequantized matmul; elsewhere (CPU, GPUs
or torch builds without blockwise scaling, shapes not multiples of 128) the weight is dequantized to the
activations' dtype and multiplied: the same numbers up to the activations' own rounding, without FP8's speed.

The operands' layouts are torch's (`_scaled_block1x128_block128x128` in ATen's `ScaledBlas.cpp`, mirrored by its
meta function, which the tests run on fake CUDA tensors): for `a: [M, K]` row-major and `b: [K, N]` column-major,
`scale_a` is `[M, K/128]` with strides `(1, M)` (M contiguous) and `scale_b` is `[L4, N/128]` with strides
`(1, L4)`, `L4 = K/128` rounded up to a multiple of 4 (16-byte aligned columns): the weight's `scale_inv`
transposed, each of its rows padded to `L4` (`gemm_scales`). Passing `scale_inv` as it is (`[N/128, K/128]`,
row-major) is refused by that check, which is why the first H200 run fell back to dequantizing. Rows of `x` are
zero-padded to a multiple of 16 (a zero row quantizes to zeros with scale 1). On CUDA the activation quantization
(`quantize_activations`) is compiled into one kernel (`CompiledOrEager`).

Assumes 2-D weights (linear layers); embeddings, norms and the output layer stay in the engine's dtype.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hf_mcore_bridge.checkpoint.fp8_blocks import BLOCK, E4M3_MAX, FP8_DTYPE, dequantize_blockwise, quantize_blockwise
from hf_mcore_bridge.engine.compiled import CompiledOrEager

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8_DTYPE",
    "dequantize_blockwise",
    "fp8_linear",
    "gemm_agrees",
    "gemm_scales",
    "quantize_activations",
    "quantize_blockwise",
    "scaled_mm_failure",
    "scaled_mm_works",
]


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x: [M, K]` with K a multiple of 128 -> `(q: [M, K] FP8, scale_inv: [M, K/128] float32)`, per 1 x 128 group;
    `scale_inv` is M-contiguous (strides `(1, M)`), the layout the blockwise GEMM reads."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    amax = groups.abs().amax(dim=-1)
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (groups / scale_inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX).view(m, k).to(FP8_DTYPE)
    return q, scale_inv.t().contiguous().t()


def gemm_scales(scale_inv: torch.Tensor) -> torch.Tensor:
    """A weight's `scale_inv: [N/128, K/128]` in the layout of the blockwise GEMM's `scale_b`: `[L4, N/128]`,
    strides `(1, L4)`, `L4` = K/128 rounded up to a multiple of 4 (the padding holds ones and is never read)."""
    blocks_k = scale_inv.shape[1]
    padded = F.pad(scale_inv.float(), (0, -(-blocks_k // 4) * 4 - blocks_k), value=1.0)
    return padded.t()


_QUANTIZE = CompiledOrEager(quantize_activations, "FP8 activation quantization")
"""`quantize_activations` compiled (CUDA inputs only): one kernel reads `x` and writes both outputs."""


def _scaled_mm(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, gemm_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """`x: [M, K]` times `q.T` through the blockwise FP8 GEMM (CUDA), output in `x.dtype`; `gemm_scale`:
    `gemm_scales(scale_inv)`, made here when not given."""
    xq, x_scale = _QUANTIZE(x) if x.is_cuda else quantize_activations(x)
    return F.scaled_mm(
        xq,
        q.t(),
        x_scale,
        F.ScalingType.BlockWise1x128,
        gemm_scales(scale_inv) if gemm_scale is None else gemm_scale,
        F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )


_FAILURES: dict[torch.device, str] = {}


@functools.cache
def scaled_mm_works(device: torch.device) -> bool:
    """Whether the blockwise FP8 GEMM runs on `device` and agrees with the dequantized matmul (`gemm_agrees`).
    CPU: False without trying. Why it does not, where it does not: `scaled_mm_failure`."""
    if device.type != "cuda":
        _FAILURES[device] = "not a CUDA device"
        return False
    return gemm_agrees(device, _scaled_mm, _FAILURES)


def scaled_mm_failure(device: torch.device) -> str | None:
    """Why `scaled_mm_works(device)` is False (the GEMM's error, or its disagreement); None where it is True."""
    return None if scaled_mm_works(device) else _FAILURES.get(device, "unknown")


def gemm_agrees(
    device: torch.device,
    gemm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    failures: dict[torch.device, str] | None = None,
) -> bool:
    """Whether `gemm(x, q, scale_inv)` runs on a random 256 x 384 x 256 product on `device` and agrees with
    `x @ dequantize(q, scale_inv).T` in float32 to 5% relative error (FP8 activation rounding is ~3%); K = 384 has
    3 blocks, so `gemm_scales` pads. Where it does not, the reason goes into `failures[device]`."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(256, 384, device=device, generator=generator).to(torch.bfloat16)
    q, scale_inv = quantize_blockwise(torch.randn(256, 384, device=device, generator=generator) * 0.05)
    expected = x.float() @ dequantize_blockwise(q, scale_inv, torch.float32).t()
    try:
        got = gemm(x, q, scale_inv).float()
    except (RuntimeError, NotImplementedError, ValueError, TypeError, AttributeError) as err:  # no F.scaled_mm
        if failures is not None:
            failures[device] = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300] if str(err) else ''}"
        return False
    if got.shape != expected.shape:
        error = f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    else:
        relative = ((got - expected).norm() / expected.norm()).item()
        if relative < 0.05:
            return True
        error = f"relative error {relative:.3g} against the dequantized matmul (limit 0.05)"
    if failures is not None:
        failures[device] = error
    return False


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemm_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """`x: [..., K]` -> `[..., N]`: `x @ dequantize(q, scale_inv).T + bias` in `x.dtype` (see the module
    docstring for when the FP8 GEMM runs); `gemm_scale`: `gemm_scales(scale_inv)`, kept by the caller to spare
    the relayout per call."""
    n, k = q.shape
    flat = x.reshape(-1, k)
    rows = flat.shape[0]
    if n % BLOCK == 0 and k % BLOCK == 0 and rows and scaled_mm_works(x.device):
        padded = -(-rows // 16) * 16
        out = _scaled_mm(F.pad(flat, (0, 0, 0, padded - rows)) if padded != rows else flat, q, scale_inv, gemm_scale)
        out = out[:rows] if padded != rows else out
        out = out if bias is None else out + bias
    else:
        out = F.linear(flat, dequantize_blockwise(q, scale_inv, x.dtype), bias)
    return out.reshape(*x.shape[:-1], n)
