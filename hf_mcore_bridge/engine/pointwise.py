"""The decoder's pointwise steps (rotary embedding, SiLU gating, residual add + RMSNorm) and `PointwiseOps`, the
set of them a model runs with: `EAGER_OPS`, or `compiled_ops()` with each step compiled by `torch.compile`.

Eager, each step is a few elementwise kernels; compiled, one fused kernel on CUDA. At 512 decoding sequences a
decode step's activations are small and its pointwise kernels are launch-bound, so fusing them shortens the step.
Numerics: the same operations; eager rounds to the activation dtype between kernels where a fused kernel keeps
float32 (equal in float32, within one rounding step in bfloat16). RMSNorm's statistics are float32 either way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hf_mcore_bridge.engine.compiled import CompiledOrEager


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding in the `rotate_half` layout. x: [T, heads, D]; cos, sin: [T, R] in x's dtype, R <= D: a
    partial rotary embedding rotates the first R dimensions and passes the others through (transformers' order)."""
    rotated_dims = cos.shape[-1]
    if rotated_dims < x.shape[-1]:
        return torch.cat((rope(x[..., :rotated_dims], cos, sin), x[..., rotated_dims:]), dim=-1)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dimension: [T, 2F] -> [T, F]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up for gate_up = [gate | up] (Gemma's GeGLU, `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual): a sublayer's output joins the residual stream, which is
    normalised for the next sublayer."""
    summed = x + residual
    return F.rms_norm(summed, weight.shape, weight, eps), summed


@dataclass(frozen=True)
class PointwiseOps:
    """The pointwise steps a model calls (see the module docstring)."""

    rope: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
    silu_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_mul: Callable[[torch.Tensor], torch.Tensor]
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], tuple[torch.Tensor, torch.Tensor]]


EAGER_OPS = PointwiseOps(rope=rope, silu_mul=silu_mul, gelu_tanh_mul=gelu_tanh_mul, add_rms_norm=add_rms_norm)


def compiled_ops() -> PointwiseOps:
    """Each step through `torch.compile` (falling back to eager if compilation fails)."""
    return PointwiseOps(
        rope=CompiledOrEager(rope, "rotary embedding"),
        silu_mul=CompiledOrEager(silu_mul, "SiLU gating"),
        gelu_tanh_mul=CompiledOrEager(gelu_tanh_mul, "GeGLU gating"),
        add_rms_norm=CompiledOrEager(add_rms_norm, "residual add + RMSNorm"),
    )
