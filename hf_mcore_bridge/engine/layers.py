"""The engine's building-block layers: RMSNorm, and linear layers whose parameters start empty (always loaded,
never initialised), plain or row-parallel, optionally multiplying by a per-block FP8 copy of their weight.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_mcore_bridge.engine.fp8 import fp8_linear, gemm_scales, quantize_blockwise, scaled_mm_works
from hf_mcore_bridge.engine.tp_group import TensorParallel


def empty_param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """An uninitialised, frozen parameter (every engine parameter is filled by loading)."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """RMSNorm with float32 statistics (`F.rms_norm`)."""

    def __init__(
        self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str, offset: bool = False
    ) -> None:
        super().__init__()
        self.weight = empty_param(size, dtype=dtype, device=device)
        self.eps = eps
        self.offset = offset
        """Scale by `1 + weight` (Gemma's norms: the stored weight is the offset from one)."""

    @property
    def scale(self) -> torch.Tensor:
        """What the normalised activations are multiplied by: the weight, or `1 + weight` (`offset`)."""
        return self.weight + 1.0 if self.offset else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused kernel on CUDA (float32 statistics). transformers rounds the normalised activations to the
        # input dtype before the weight multiply; this rounds once, at the end: identical in float32, and in
        # bfloat16 within one rounding step.
        return F.rms_norm(x, self.weight.shape, self.scale, self.eps)


class Linear(nn.Module):
    """A linear layer whose parameters start empty (they are always loaded, never initialised). `fp8`, once set by
    `quantize_fp8`, holds the weight's per-block FP8 copy, its scales (`engine.fp8`) and those scales in the FP8
    GEMM's layout (`fp8.gemm_scales`), and the layer multiplies by that copy instead of `weight` (which stays:
    loads and the refit's checks read it)."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.weight = empty_param(out_features, in_features, dtype=dtype, device=device)
        self.bias = empty_param(out_features, dtype=dtype, device=device) if bias else None
        self.fp8: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self.lora_a: nn.Parameter | None = None
        """LoRA adapters applied by this layer (`engine.lora`): the A of each adapted projection stacked
        [projections x rank, in_features], and `lora_b` [out_features, projections x rank] (each projection's B in its
        own rows and rank columns, zero elsewhere); the layer adds `lora_scale` * lora_b lora_a x."""
        self.lora_b: nn.Parameter | None = None
        self.lora_scale = 1.0

    def quantize_fp8(self) -> None:
        """(Re)quantize `weight` into the FP8 copy, in place once it exists (captured CUDA graphs read it)."""
        q, scale_inv = quantize_blockwise(self.weight.detach())
        scaled_mm_works(q.device)  # decided now, eagerly, not inside a graph capture
        if self.fp8 is None:
            self.fp8 = (q, scale_inv, gemm_scales(scale_inv))
        else:
            self.fp8[0].copy_(q)
            self.fp8[1].copy_(scale_inv)
            self.fp8[2].copy_(gemm_scales(scale_inv))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8 is None:
            out = F.linear(x, self.weight, bias)
        else:
            q, scale_inv, gemm_scale = self.fp8
            out = fp8_linear(x, q, scale_inv, bias, gemm_scale)
        if self.lora_a is None or self.lora_b is None:
            return out
        low = F.linear(x, self.lora_a).reshape(-1, self.lora_a.shape[0])
        flat = torch.addmm(out.reshape(-1, out.shape[-1]), low, self.lora_b.t(), alpha=self.lora_scale)
        return flat.view(out.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class RowLinear(Linear):
    """A row-parallel linear layer: this rank's input columns, the partial outputs summed over the group (then the
    bias, once). With `tp` None, a plain `Linear`."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype, device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.matmul(x, self.bias)
        out = self.tp.all_reduce(self.matmul(x, None))
        return out if self.bias is None else out + self.bias
