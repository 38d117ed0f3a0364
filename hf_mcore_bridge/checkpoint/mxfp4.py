"""MXFP4 (the OCP Microscaling format's FP4 type) as GPT-OSS's published checkpoints store their experts.

A tensor `X` of `[..., K]` values is stored as `X_blocks` (uint8 `[..., K / 32, 16]`: each block of 32 values, two
per byte, the even-indexed value in the low nibble) and `X_scales` (uint8 `[..., K / 32]`: one e8m0 scale per block,
the exponent biased by 127). A value is `E2M1[nibble] * 2 ** (scale - 127)`, where e2m1 has a sign bit (8), two
exponent bits and one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives. Every such value is exact in
bfloat16 (8 exponent bits, like e8m0, and subnormals below), so dequantizing loses nothing.

`quantize` goes back: with the scales a tensor was dequantized with, it gives the same bytes again (the sign of a
zero too); with none, it takes the OCP scale `floor(log2(max |v|)) - 2` of each block and rounds each value to the
nearest e2m1 value (ties to the even mantissa), saturating at 6 * 2 ** scale.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

BLOCK = 32
"""Values per block, sharing one scale."""
BIAS = 127
"""The e8m0 scale's exponent bias."""
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The e2m1 value of each 4-bit code."""
E2M1_EMAX = 2
"""The exponent of e2m1's largest power of two (4 = 2 ** 2): the OCP scale is the block's exponent minus it."""


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`[..., G, 16]` uint8 blocks and `[..., G]` uint8 scales -> `[..., G * 32]` values (bfloat16 unless `dtype`).
    ValueError: shapes that do not pair."""
    import torch

    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not pair with scales {tuple(scales.shape)}")
    table = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = table[codes] * torch.exp2(scales.to(torch.float32) - BIAS).unsqueeze(-1)
    return values.flatten(-2).to(dtype or torch.bfloat16)


def quantize(values: torch.Tensor, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., K]` values -> (`[..., K / 32, 16]` uint8 blocks, `[..., K / 32]` uint8 scales). With `scales`, each
    block keeps its scale (ValueError where a value is not exact with it); without, the OCP scale and rounding."""
    import torch

    if values.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs a last dimension of whole blocks of {BLOCK}, not {values.shape[-1]}")
    grouped = values.to(torch.float32).unflatten(-1, (-1, BLOCK))
    kept = scales is not None
    if scales is None:
        largest = grouped.abs().amax(dim=-1)
        exponent = torch.floor(torch.log2(largest.clamp(min=2.0**-BIAS))) - E2M1_EMAX
        scales = (exponent + BIAS).clamp(0, 254).to(torch.uint8)
    if scales.shape != grouped.shape[:-1]:
        raise ValueError(f"MXFP4 scales {tuple(scales.shape)} do not pair with {tuple(grouped.shape[:-1])} blocks")
    codes = _nearest_codes(grouped / torch.exp2(scales.to(torch.float32) - BIAS).unsqueeze(-1))
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    if kept and not torch.equal(dequantize(blocks, scales, torch.float32).view(values.shape), values.float()):
        raise ValueError("values are not exact in MXFP4 with the given scales")
    return blocks, scales


def _nearest_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The e2m1 code nearest each value (ties to the even code, so to the even mantissa), saturating at +-6; a zero
    keeps its sign."""
    import torch

    magnitudes = torch.tensor(E2M1[:8], dtype=torch.float32)
    distance = (scaled.abs().unsqueeze(-1) - magnitudes).abs()
    nearest = distance == distance.amin(dim=-1, keepdim=True)
    preference = torch.tensor([2, 1] * 4)  # among the nearest, an even code (even mantissa) first
    code = torch.argmax(nearest * preference, dim=-1)
    return (code + 8 * torch.signbit(scaled).long()).to(torch.uint8)
