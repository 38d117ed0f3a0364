"""Per-block FP8 (e4m3) weights: 128 x 128 blocks, each with its float32 scale. Pure tensor functions.

A weight `w: [N, K]` is cut into 128 x 128 blocks (the last row and column of blocks may be smaller when N or K
is not a multiple of 128); each block is divided by `scale_inv = amax(|block|) / 448` (448: the largest finite
`float8_e4m3fn`) and rounded to e4m3. `scale_inv: [ceil(N/128), ceil(K/128)]` float32 is what DeepSeek-V3's
checkpoints call `weight_scale_inv`: the dequantized weight is `q * scale_inv` per block. A block of zeros gets
`scale_inv` 1 (any value gives back zeros).

`pow2=True` rounds each scale up to a power of two (the `ue8m0` scales DeepSeek-V3.1's checkpoints use): the
dequantized values `q * scale_inv` are then exact in bfloat16, and quantizing them again gives them back exactly.
`keep=` offers each block a scale to keep (the scales a checkpoint was read with): a block whose values are exactly
`(q * keep).to(weight.dtype)` for some e4m3 `q` (a block dequantized from those scales and not changed since) is
written as that `q` and that scale, bit for bit the source's encoding, whatever rounding to `weight.dtype` did to
its values; `q` is found as the e4m3 nearest `value / keep`, which is `q` itself because the dtype's rounding (at
most 2^-8 relative in bfloat16) is far inside half of e4m3's spacing (at least 2^-5 relative).
The engine (`engine.fp8`) and checkpoint conversion (`convert.fp8_checkpoint`) both use these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hf_mcore_bridge.checkpoint.fp8_geometry import BLOCK, scale_shape
from hf_mcore_bridge.checkpoint.fp8_geometry import blocks as _blocks

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


def quantize_blockwise(
    weight: torch.Tensor, *, pow2: bool = False, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight: [N, K]` (any float dtype) -> `(q: [N, K] float8_e4m3fn, scale_inv: [ceil(N/128), ceil(K/128)]
    float32)` with `q * scale_inv` (per block) approximating `weight`; `pow2`: scales rounded up to powers of two.
    `keep: [ceil(N/128), ceil(K/128)]`: per block, a scale kept where the block is exactly `q * keep` (finite,
    positive, a power of two with `pow2`). Non-finite weights are refused."""
    if weight.dim() != 2:
        raise ValueError(f"blockwise FP8 quantizes 2-D weights, got shape {tuple(weight.shape)}")
    if not torch.isfinite(weight).all():
        raise ValueError("cannot quantize a weight holding inf or nan to FP8")
    n, k = weight.shape
    blocks = _padded(weight)
    if keep is None:
        q, scale_inv = _fresh(blocks, pow2=pow2)
    else:
        if tuple(keep.shape) != scale_shape((n, k)):
            raise ValueError(f"keep {tuple(keep.shape)} does not fit a {n} x {k} weight in 128 x 128 blocks")
        keep = keep.float()
        q, fits = _kept(blocks, keep, weight.dtype, pow2=pow2)
        scale_inv = keep
        if not fits.all():  # blocks changed since (or a scale of the other format): their own scales
            fresh_q, fresh_scale = _fresh(blocks, pow2=pow2)
            q = torch.where(fits[:, None, :, None], q, fresh_q)
            scale_inv = torch.where(fits, keep, fresh_scale)
    q = q.view(_blocks(n) * BLOCK, _blocks(k) * BLOCK)[:n, :k]
    return q.contiguous(), scale_inv.contiguous()


def _fresh(blocks: torch.Tensor, *, pow2: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded blocks `[N/128, 128, K/128, 128]` float32 -> e4m3 codes at scales of their own (amax / 448, rounded
    up to a power of two with `pow2`; 1 for a block of zeros)."""
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    if pow2:
        scale_inv = torch.exp2(torch.ceil(torch.log2(scale_inv)))
    return _encoded(blocks, scale_inv), scale_inv


def _encoded(blocks: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Padded blocks `[N/128, 128, K/128, 128]` float32 -> their nearest e4m3 codes at these scales."""
    return (blocks / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _kept(
    blocks: torch.Tensor, keep: torch.Tensor, dtype: torch.dtype, *, pow2: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The e4m3 codes of the padded blocks at the scales `keep`, and which blocks they give back exactly (as
    `dequantize_rows` computes them, in `dtype`) with a usable scale."""
    usable = torch.isfinite(keep) & (keep > 0)
    if pow2:
        usable &= keep == torch.exp2(torch.round(torch.log2(keep)))
    scale = torch.where(usable, keep, torch.ones_like(keep))
    q = _encoded(blocks, scale)
    back = (q.float() * scale[:, None, :, None]).to(dtype).float()
    return q, usable & (back == blocks).all(dim=3).all(dim=1)


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
