"""Paged decode attention as one Triton kernel: each program reads one sequence's KV blocks in place, for one KV head.

One query token per sequence attends over its cached tokens (the new one written before the call), read through
its block table straight from the cache `[2, num_blocks, block_size, kv_heads, head_dim]` (one layer's slice of
the engine's cache): nothing is gathered, padded or masked in memory. A program handles one (sequence, KV head)
pair and every query head of its group (grouped-query attention), so each key and value row is read once, and
runs an online softmax (base 2) over tiles of blocks (64 or 128 tokens, `tile_blocks`). Scores and the value
product use `tl.dot` with the group's query heads padded to 16 rows (the smallest matrix-multiply tile); the
kernel is bound by memory, not arithmetic, so the padding costs no extra reads.

Sliding window (per layer) and attention sinks (per query head, GPT-OSS): a program's range starts at the
window's first position, so only the window's blocks are read, and with `splits` the window's blocks (not the whole
table's) are shared out; the first split starts its online softmax from the sink (maximum = the sink's logit,
normaliser 1, nothing added to the values), so the sink joins the denominator once.

Split-KV: when sequences x KV heads are too few to fill the GPU (small batches, long contexts), each sequence's
blocks are split into `splits` contiguous ranges, one program each; the programs write float32 partial sums with
their running maximum and normaliser, and a short torch epilogue combines them (log-sum-exp weighting). The
number of splits depends only on the shapes, so the kernel can be captured in a CUDA graph.

FP8 cache (float8_e4m3fn entries, each the value over a per-tensor `kv_scale`): each tile is converted to the
query's dtype as it is loaded, `kv_scale` is folded into the score scale and the output is multiplied by it; the
bytes read per token halve.

Numerics: bf16 / fp16 products on tensor cores with float32 accumulation, the probabilities rounded to the cache
dtype before the value product (as flash attention does); float32 caches use exact float32 products
(`input_precision="ieee"`, no TF32), so an fp32 engine matches transformers to rounding.

CPU tensors run in Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is imported: the test suite's
conftest does so on machines without CUDA), for tests only: it is slow, and since the interpreter's bf16 `tl.dot`
is unreliable, its products are taken in float32 from the same (rounded) operands. Triton itself is imported only
when the kernel is first used.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
from collections.abc import Callable
from typing import Any

import torch

TILE_TOKENS = (64, 128)
"""Tokens per tile of the kernel's loop: the first for ranges shorter than `LONG_RANGE_TOKENS` (a short sequence
wastes less of its last tile), the second for longer ones. Measured on an H200 (`scripts/bench_decode_attention.py`,
`docs/PERFORMANCE.md`)."""
LONG_RANGE_TOKENS = 512
NUM_WARPS = 4
NUM_STAGES = 2
MIN_BLOCKS_PER_SPLIT = 4
"""A split reads at least this many blocks: shorter ranges cost more in the epilogue than they gain."""
NO_WINDOW = 1 << 30
"""The window passed for a layer without one (longer than any context)."""
MIN_HEAD_DIM = 16
"""`tl.dot` needs an inner dimension of at least 16."""


def available() -> bool:
    """Whether Triton is installed (it ships with torch's CUDA builds on Linux); nothing is imported."""
    return importlib.util.find_spec("triton") is not None


@functools.cache
def _kernel() -> Any:
    """The Triton kernel (compiled on first launch per set of constants; interpreted under TRITON_INTERPRET=1)."""
    import triton

    from hf_mcore_bridge.engine.paged_decode_kernel import paged_decode_kernel

    return triton.jit(paged_decode_kernel)


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (the variable must be set before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (4 for the interpreter, so that tests reach the split path)."""
    if device.type != "cuda":
        return 4
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def supports(head_dim: int) -> bool:
    """Whether the kernel takes this head dimension (a power of two, at least `MIN_HEAD_DIM`)."""
    return head_dim >= MIN_HEAD_DIM and head_dim & (head_dim - 1) == 0


def check_usable(device: torch.device, head_dim: int, block_size: int) -> None:
    """Raises ValueError, naming the reason, where the kernel cannot run: Triton missing, a CPU device outside
    Triton's interpreter, or a head dimension or block size it does not take."""
    if not available():
        raise ValueError("the triton decode kernel needs Triton (shipped with torch's CUDA builds on Linux)")
    if device.type != "cuda" and not interpreted():
        raise ValueError(
            "the triton decode kernel runs on CUDA devices (on CPU only in Triton's interpreter, TRITON_INTERPRET=1, "
            "set before Triton is imported)"
        )
    if not supports(head_dim) or block_size & (block_size - 1):
        raise ValueError(
            f"the triton decode kernel needs a power-of-two head_dim >= {MIN_HEAD_DIM} (got {head_dim}) and a "
            f"power-of-two block_size (got {block_size}); use decode_attention flex or gather"
        )


def num_splits(batch: int, kv_heads: int, n_blocks: int, sm_count: int) -> int:
    """Splits per sequence: 1 when the batch gives at least two programs per SM; otherwise enough for about four
    per SM, each over at least `MIN_BLOCKS_PER_SPLIT` blocks of the table."""
    programs = batch * kv_heads
    if programs >= 2 * sm_count:
        return 1
    wanted = math.ceil(4 * sm_count / programs)
    return max(1, min(wanted, n_blocks // MIN_BLOCKS_PER_SPLIT))


def tile_blocks(block_size: int, blocks_per_split: int) -> int:
    """KV blocks per tile for a program that reads up to `blocks_per_split` blocks (`TILE_TOKENS`)."""
    short, long = TILE_TOKENS
    tokens = long if blocks_per_split * block_size >= LONG_RANGE_TOKENS else short
    return max(1, tokens // block_size, -(-MIN_HEAD_DIM // block_size))


def paged_decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    splits: int | None = None,
    tile: int | None = None,
    kv_scale: float = 1.0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per sequence over its cached tokens (the last `window` of them; None: all),
    with a sink logit per query head (`sinks` [heads]; None: none).

    q: [B, heads, D] (any strides with a contiguous last dimension); layer_cache: [2, NB, BS, kv_heads, D];
    block_tables: [B, n_blocks] (entries past a sequence's used blocks are never read); context_lens: [B]
    (0 for a padding row, whose output is zero). `splits`: split-KV ranges per sequence (None: `num_splits`);
    `tile`: KV blocks per tile (None: `tile_blocks`); `kv_scale`: an FP8 cache's per-tensor scale (the cache holds
    value / kv_scale). Returns [B, heads, D] in q's dtype.
    """
    batch, heads, head_dim = q.shape
    _, _, block_size, kv_heads, cache_dim = layer_cache.shape
    if cache_dim != head_dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {kv_heads} KV heads x {cache_dim}")
    check_usable(q.device, head_dim, block_size)
    if q.stride(-1) != 1 or layer_cache.stride(-1) != 1:
        raise ValueError("q and the cache need a contiguous last dimension")
    n_blocks = block_tables.shape[1]
    if window is not None:  # the blocks a window of `window` positions can touch
        n_blocks = min(n_blocks, (window - 1) // block_size + 2)
    if splits is None:
        splits = num_splits(batch, kv_heads, n_blocks, device_sm_count(q.device))
    splits = max(1, min(splits, n_blocks))
    blocks_per_split = math.ceil(n_blocks / splits)
    if tile is None:
        tile = tile_blocks(block_size, blocks_per_split)
    group = heads // kv_heads
    interpret = interpreted()
    fp32 = q.dtype == torch.float32
    keys, values = layer_cache[0], layer_cache[1]
    if splits == 1:
        out = torch.empty(batch, heads, 1, head_dim, dtype=q.dtype, device=q.device)
        stats = out  # unused
    else:
        out = torch.empty(batch, heads, splits, head_dim, dtype=torch.float32, device=q.device)
        stats = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    launch: Callable[..., Any] = _kernel()[(batch, kv_heads, splits)]
    launch(
        q,
        keys,
        values,
        block_tables,
        context_lens,
        out,
        stats,
        sinks if sinks is not None else out,  # unused without sinks
        window if window is not None else NO_WINDOW,
        scale * math.log2(math.e) * kv_scale,
        kv_scale,
        blocks_per_split,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        GROUP=group,
        GROUP_PAD=max(16, 1 << (group - 1).bit_length()),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_BLOCKS=tile,
        DOT_FP32=fp32 or interpret,
        PRECISION="ieee" if fp32 else None,  # the precision of float32 products only
        NORMALISE=splits == 1,
        HAS_SINKS=sinks is not None,
        **({} if interpret else {"num_warps": NUM_WARPS, "num_stages": NUM_STAGES}),
    )
    if splits == 1:
        return out.squeeze(2)
    return combine_splits(out, stats).to(q.dtype)


def combine_splits(partial: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """Split-KV epilogue: partial sums [B, H, S, D] with (max, normaliser) [B, H, S, 2] (base 2) -> [B, H, D]."""
    running_max, normaliser = stats.unbind(-1)
    top = running_max.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a padding row: every split empty
    weight = torch.exp2(running_max - top)
    total = (normaliser * weight).sum(-1, keepdim=True)
    summed = (partial * weight.unsqueeze(-1)).sum(2)
    return summed / torch.where(total > 0, total, torch.ones_like(total))
