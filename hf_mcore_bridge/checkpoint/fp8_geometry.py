"""The shapes of 128 x 128 FP8 weight blocks and their scales, without torch (planning an FP8 checkpoint's tensors).

A weight `[N, K]` is cut into 128 x 128 blocks (the last row and column of blocks may be smaller); its
`weight_scale_inv` holds one float32 per block: `[ceil(N/128), ceil(K/128)]`. `fp8_blocks` quantizes and
dequantizes by these shapes.
"""

from __future__ import annotations

BLOCK = 128
"""Block edge of the weight scales."""


def blocks(n: int) -> int:
    """Blocks along a dimension of `n` elements."""
    return -(-n // BLOCK)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The `scale_inv` shape of a `[N, K]` weight: `(ceil(N/128), ceil(K/128))`."""
    n, k = shape
    return blocks(n), blocks(k)
