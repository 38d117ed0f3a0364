"""Paged multi-latent decode attention as one Triton kernel: the absorbed attention of `mla.absorbed_decode` read
straight from the latent cache's blocks.

One query token per sequence attends over its cached entries, each `kv_lora_rank` latent values then
`qk_rope_head_dim` rotary-key values, one entry shared by every head (`mla.py`): a head's score of token t is
(q_latent . c_kv[t] + q_rope . k_pe[t]) * scale, its output the softmax-weighted sum of the latents c_kv[t], a
latent per head that the caller multiplies by W_UV. A program handles one sequence and a block of `HEADS` heads
(16, `tl.dot`'s smallest tile; DeepSeek-V3's 128 heads take 8 programs, each reading the sequence's entries once:
they are 576 values a token, against the 128 x 320 values of decompressed keys and values) and runs an online
softmax (base 2) over tiles of blocks; the latent and rotary parts of each entry are loaded as two tiles (their
widths padded to powers of two, masked), so any rank and rotary width is taken. Split-KV, the epilogue and the
numerics are those of `triton_decode` (float32 accumulation, the probabilities rounded to the activations'
dtype before the value product, exact float32 products for float32 models), and so is the CPU story: CPU tensors
run in Triton's interpreter (`TRITON_INTERPRET=1`), for tests only.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch

from hf_mcore_bridge.engine.triton_decode import available, combine_splits, device_sm_count, interpreted, num_splits

HEADS = 16
"""Query heads a program handles (`tl.dot`'s smallest tile)."""
TILE_TOKENS = 32
"""Cache entries per tile for wide latents (rank over 256: a [32, 512] bf16 tile is 32 KB per pipeline stage);
narrower ones take 64."""
NUM_STAGES = 2


@functools.cache
def _kernel() -> Any:
    import triton

    from hf_mcore_bridge.engine.mla_decode_kernel import mla_decode_kernel

    return triton.jit(mla_decode_kernel)


def check_usable(device: torch.device, block_size: int) -> None:
    """Raises ValueError, naming the reason, where the kernel cannot run: Triton missing, a CPU device outside
    Triton's interpreter, or a block size that is not a power of two."""
    if not available():
        raise ValueError("the triton latent decode kernel needs Triton (shipped with torch's CUDA builds on Linux)")
    if device.type != "cuda" and not interpreted():
        raise ValueError(
            "the triton latent decode kernel runs on CUDA devices (on CPU only in Triton's interpreter, "
            "TRITON_INTERPRET=1, set before Triton is imported)"
        )
    if block_size & (block_size - 1):
        raise ValueError(
            f"the triton latent decode kernel needs a power-of-two block_size (got {block_size}); "
            "use decode_attention gather"
        )


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def paged_mla_decode(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    tile: int | None = None,
) -> torch.Tensor:
    """The latent attention output of one query token per sequence over its cached entries.

    q_latent: [B, heads, rank] (q_nope times W_UK); q_rope: [B, heads, rope] (rotated); layer_cache: [1, NB, BS, 1,
    rank + rope]; block_tables: [B, n_blocks]; context_lens: [B] (0 for a padding row, whose output is zero).
    `splits`: split-KV ranges per sequence (None: `triton_decode.num_splits`); `tile`: blocks per tile (None:
    `TILE_TOKENS` worth, 64 entries for ranks up to 256). Returns [B, heads, rank] in q_latent's dtype.
    """
    batch, heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    _, _, block_size, cache_heads, width = layer_cache.shape
    if cache_heads != 1 or width != rank + rope or q_rope.shape[:2] != (batch, heads):
        raise ValueError(
            f"q_latent {tuple(q_latent.shape)} and q_rope {tuple(q_rope.shape)} do not fit a latent cache of "
            f"{cache_heads} heads x {width}"
        )
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1 or layer_cache.stride(-1) != 1:
        raise ValueError("the queries and the cache need a contiguous last dimension")
    check_usable(q_latent.device, block_size)
    head_blocks = -(-heads // HEADS)
    n_blocks = block_tables.shape[1]
    if splits is None:
        splits = num_splits(batch, head_blocks, n_blocks, device_sm_count(q_latent.device))
    splits = max(1, min(splits, n_blocks))
    blocks_per_split = math.ceil(n_blocks / splits)
    if tile is None:
        tokens = TILE_TOKENS if rank > 256 else 2 * TILE_TOKENS
        tile = max(1, tokens // block_size, -(-16 // block_size))
    interpret = interpreted()
    fp32 = q_latent.dtype == torch.float32
    cache = layer_cache[0, :, :, 0]  # [NB, BS, width]
    if splits == 1:
        out = torch.empty(batch, heads, 1, rank, dtype=q_latent.dtype, device=q_latent.device)
        stats = out  # unused
    else:
        out = torch.empty(batch, heads, splits, rank, dtype=torch.float32, device=q_latent.device)
        stats = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q_latent.device)
    launch: Callable[..., Any] = _kernel()[(batch, head_blocks, splits)]
    launch(
        q_latent,
        q_rope,
        cache,
        block_tables,
        context_lens,
        out,
        stats,
        scale * math.log2(math.e),
        blocks_per_split,
        heads,
        q_latent.stride(0),
        q_latent.stride(1),
        q_rope.stride(0),
        q_rope.stride(1),
        cache.stride(0),
        cache.stride(1),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        RANK=rank,
        RANK_PAD=_pow2(rank),
        ROPE=rope,
        ROPE_PAD=_pow2(rope),
        HEADS_PAD=HEADS,
        BLOCK_SIZE=block_size,
        TILE_BLOCKS=tile,
        DOT_FP32=fp32 or interpret,
        PRECISION="ieee" if fp32 else None,
        NORMALISE=splits == 1,
        **({} if interpret else {"num_warps": 8 if rank > 256 else 4, "num_stages": NUM_STAGES}),
    )
    if splits == 1:
        return out.squeeze(2)
    return combine_splits(out, stats).to(q_latent.dtype)
