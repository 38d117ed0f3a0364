"""Per-block FP8 (e4m3) weights: 128 x 128 blocks, each with its float32 scale. Pure tensor functions.

A weight `w: [N, K]` is cut into 128 x 128 blocks (the last row and column of blocks may be smaller when N or K
is not a multiple of 128); each block is divided by `scale_inv = amax(|block|) / 448` (448: the largest finite
`float8_e4m3fn`) and rounded to e4m3. `scale_inv: [ceil(N/128), ceil(K/128)]` float32 is what DeepSeek-V3's
checkpoints call `weight_scale_inv`: the dequantized weight is `q * scale_inv` per block. A block of zeros gets
`scale_inv` 1 (any value gives back zeros).

`pow2=True` rounds each scale up to a power of two (the `ue8m0` scales DeepSeek-V3.1's checkpoints use): the
dequantized values `q * scale_inv` are then exact in bfloat16, and quantizing them again gives them back exactly.
The engine (`engine.fp8`) and checkpoint conversion (`convert.fp8_checkpoint`) both use these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_mcore_bridge.convert.fp8_geometry import BLOCK, scale_shape
from hf_mcore_bridge.convert.fp8_geometry import blocks as _blocks

__all__ = [
    "BLOCK",
    "E4M3_MAX",
    "FP8_DTYPE",
    "dequantize_blockwise",
    "dequantize_rows",
    "quantize_blockwise",
    "scale_shape",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(FP8_DTYPE).max)
"""448."""


def _padded(weight: torch.Tensor) -> torch.Tensor:
    """`weight: [N, K]` zero-padded to multiples of `BLOCK`, viewed as `[N/128, 128, K/128, 128]` in float32."""
    n, k = weight.shape
    padded = F.pad(weight.float(), (0, _blocks(k) * BLOCK - k, 0, _blocks(n) * BLOCK - n))
    return padded.view(_blocks(n), BLOCK, _blocks(k), BLOCK)


def quantize_blockwise(weight: torch.Tensor, *, pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight: [N, K]` (any float dtype) -> `(q: [N, K] float8_e4m3fn, scale_inv: [ceil(N/128), ceil(K/128)]
    float32)` with `q * scale_inv` (per block) approximating `weight`; `pow2`: scales rounded up to powers of two.
    Non-finite weights are refused."""
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("cannot quantize a weight holding inf or nan to FP8")
    n, k = weight.shape
    blocks = _padded(weight)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    scaled = (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX)
    q = scaled.view(_blocks(n) * BLOCK, _blocks(k) * BLOCK)[:n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()


def dequantize_blockwise(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`q: [N, K]` FP8 and `scale_inv: [ceil(N/128), ceil(K/128)]` -> `[N, K]` in `dtype` (scaled in float32)."""
    if tuple(scale_inv.shape) != scale_shape(tuple(q.shape)):
        raise ValueError(
            f"scale_inv {tuple(scale_inv.shape)} does not fit a {q.shape[0]} x {q.shape[1]} weight in 128 x 128 blocks"
        )
    return dequantize_rows(q, scale_inv, 0, dtype)


def dequantize_rows(q: torch.Tensor, block_scales: torch.Tensor, first_row: int, dtype: torch.dtype) -> torch.Tensor:
    """Rows `first_row .. first_row + len(q)` of a blockwise-FP8 weight -> `dtype` (scaled in float32).

    q: [R, K] FP8; block_scales: the scale rows of the blocks those rows fall in, `[ceil((first_row + R) / 128) -
    first_row // 128, ceil(K/128)]`."""
    rows, k = q.shape
    offset = first_row % BLOCK
    scales = block_scales.float().repeat_interleave(BLOCK, 0)[offset : offset + rows].repeat_interleave(BLOCK, 1)
    return (q.float() * scales[:, :k]).to(dtype)
