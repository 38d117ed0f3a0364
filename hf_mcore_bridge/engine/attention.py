"""Attention over the paged KV cache: torch SDPA for prefill; a Triton kernel, FlexAttention or SDPA over gathered
blocks for decode.

Layout: the whole cache is one tensor `[layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]`, so one
token's keys of one layer are a contiguous `[kv_heads, head_dim]` row addressed by a flat slot index
(`block * block_size + offset`), and a block copy (copy-on-write) is one indexed assignment over every layer.
A multi-latent-attention model's cache has one plane and one "head" instead, `[layers, 1, num_blocks, block_size,
1, kv_lora_rank + qk_rope_head_dim]`: each token's normed latent and shared rotary key (`mla.py`), the same paged
blocks and block tables.

Two attention shapes:
- prefill: each sequence of the batch attends only to its own fresh tokens (a prompt is computed once, with no
  cached context before it), so q, k, v are padded to `[batch, heads, max_len, head_dim]` and masked
  (causal within a sequence, padding keys hidden). Keys/values are also written into the cache.
- decode: one query token per sequence, its keys/values written to the cache first. Three kernels:
  - `triton` (CUDA default where Triton is installed): `triton_decode.paged_decode_attention`, one kernel that
    reads each sequence's blocks in place through its block table, split over the KV length when the batch is
    too small to fill the GPU. Compiled once per process (not per batch bucket).
  - `flex`: FlexAttention reads the blocks in place. A layer's cache is viewed as one
    `[1, kv_heads, num_blocks * block_size, head_dim]` sequence shared by the batch, and a `BlockMask` whose
    KV-block size is the cache's block size lists each sequence's blocks (its block table) and hides the unwritten
    tail of its last block. Compiled on CUDA (a Triton decoding kernel, grouped-query heads handled in the
    kernel, once per batch bucket: the engine uses it for buckets of at least `EngineConfig.flex_min_batch`
    rows); eager elsewhere (exact, but it scores every slot: for tests).
  - `gather`: the sequence's blocks are gathered through its block table into `[batch, kv_heads, n_blocks *
    block_size, head_dim]` and masked past its length, then SDPA (plain torch, any device). Grouped-query
    attention folds a KV head's query heads into the query-length axis, exact because decode has no causal mask.
Every shape depends only on (batch, n_blocks), so the decode step can be captured in a CUDA graph.

Sliding windows (per layer) and attention sinks (per head; GPT-OSS): in prefill and `gather` as `sinks_windows`
describes (a mask term, one extra key); the Triton kernel starts each sequence's loop at its window (it reads only
the window's blocks) and starts its softmax from the sink. FlexAttention decode implements neither (refused for
such a model by the engine).

FP8 cache (`EngineConfig.kv_cache_dtype: fp8`): the cache holds e4m3 keys and values, each stored as
`value / kv_scale` (one per-tensor scale, `EngineConfig.kv_cache_scale`, the same for keys and values of every
layer: vLLM's uncalibrated default is 1), rounded to nearest and clamped to +-448. Prefill attends over its fresh
keys and values (unrounded); decode reads the rounded ones: the Triton kernel converts each tile to the query's
dtype, folds `kv_scale` into the score scale and multiplies its output by it, and `gather` converts what it
gathered. The cache is written, gathered and copied through uint8 views of the same bytes (torch has no
`index_copy_` for float8 on CPU). FlexAttention does not read an FP8 cache (refused by the engine).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from hf_mcore_bridge.engine.compiled import CompiledOrEager
from hf_mcore_bridge.engine.gated_delta import LinearBatch
from hf_mcore_bridge.engine.sinks_windows import (
    append_sink_key,
    window_key_bias,
    window_visible,
    with_sink_dims,
    with_zero_dims,
)
from hf_mcore_bridge.engine.triton_decode import paged_decode_attention

FP8_CACHE_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_CACHE_DTYPE).max)


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache's bytes as uint8 (the same storage), for the indexed copies torch lacks for float8; any
    other cache as it is."""
    return cache.view(torch.uint8) if cache.dtype == FP8_CACHE_DTYPE else cache


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """Keys or values as the cache stores them: `x` itself, or in an FP8 cache `x / kv_scale` rounded to e4m3
    (clamped to its finite range)."""
    if cache_dtype != FP8_CACHE_DTYPE:
        return x
    return (x.float() / kv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_CACHE_DTYPE)


def _to_cache_pair(
    k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype, kv_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return to_cache(k, cache_dtype, kv_scale), to_cache(v, cache_dtype, kv_scale)


_TO_CACHE = CompiledOrEager(_to_cache_pair, "FP8 KV-cache quantization")
"""`to_cache` of keys and values compiled (CUDA inputs only): one kernel for both instead of eight."""


def from_cache(x: torch.Tensor, dtype: torch.dtype, kv_scale: float) -> torch.Tensor:
    """What `to_cache` stored, in `dtype` (an FP8 entry times `kv_scale`)."""
    if x.dtype != FP8_CACHE_DTYPE:
        return x
    return (x.float() * kv_scale).to(dtype)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    planes: int = 2,
) -> torch.Tensor:
    """The cache tensor `[layers, planes, num_blocks, block_size, kv_heads, head_dim]`, zero-filled (`planes`: 2,
    keys and values; 1, a multi-latent cache's one entry per token, `kv_heads` 1 and `head_dim` its width)."""
    shape = (num_layers, planes, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, planes: int = 2) -> int:
    """Bytes one token takes in the cache across all layers (`allocate_kv_cache`'s arguments): grouped-query
    attention 2 * layers * kv_heads * head_dim * itemsize; multi-latent layers * (kv_lora_rank + qk_rope_head_dim)
    * itemsize."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * planes * num_kv_heads * head_dim * itemsize


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, planes: int = 2
) -> int:
    """Bytes one block takes across all layers, keys and values."""
    return block_size * bytes_per_token(num_layers, num_kv_heads, head_dim, dtype, planes)


@dataclass(frozen=True)
class PrefillMetadata:
    """Where each token of a packed prefill batch sits, for padding and for the cache write."""

    slot_mapping: torch.Tensor
    """[T] int64: cache slot of each token."""
    pad_index: torch.Tensor
    """[T] int64: position of each token in the padded `[batch * max_len]` layout."""
    key_valid: torch.Tensor
    """[batch, max_len] bool: True where the padded position holds a real token."""
    batch_size: int
    max_len: int
    linear: LinearBatch | None = None
    """A hybrid model's sequences and state slots for its Gated DeltaNet layers (`gated_delta.prefill_batch`),
    built once per pass; None for a model without them."""
    kv_scale: float = 1.0
    """Per-tensor scale of an FP8 cache's entries (`to_cache`); unused for a cache in the activations' dtype."""


@dataclass(frozen=True)
class DecodeMetadata:
    """One new token per sequence: where it is written and which blocks its sequence reads."""

    slot_mapping: torch.Tensor
    """[B] int64: cache slot of the new token."""
    block_tables: torch.Tensor
    """[B, n_blocks] int64: the sequence's blocks, padded with the scratch block."""
    context_lens: torch.Tensor
    """[B] int64: tokens of the sequence in the cache, the new one included."""
    key_bias: torch.Tensor | None = None
    """[B, 1, 1, n_blocks * block_size] additive mask (0 or -inf) in the activation dtype; built once per forward
    pass by `with_key_bias` rather than once per layer (`gather` kernel)."""
    block_mask: Any = None
    """FlexAttention `BlockMask` over the cache's blocks (`flex` kernel), built once per forward pass by
    `with_block_mask`."""
    triton: bool = False
    """Decode through the Triton kernel (`triton`), which needs nothing beyond the block tables and lengths."""
    kv_scale: float = 1.0
    """Per-tensor scale of an FP8 cache's entries (`to_cache`); unused for a cache in the activations' dtype."""
    fused_rope: bool = False
    """Rotate q and k and write the cache in one kernel (`triton_rope`), with the Triton decode kernel only."""
    linear: LinearBatch | None = None
    """A hybrid model's state slot per row for its Gated DeltaNet layers (`gated_delta.decode_batch`; padded rows
    the scratch slot), built once per pass; None for a model without them."""


def with_key_bias(meta: DecodeMetadata, block_size: int, dtype: torch.dtype) -> DecodeMetadata:
    """`meta` with its additive key mask: keys at or past a sequence's length are hidden."""
    batch, n_blocks = meta.block_tables.shape
    positions = torch.arange(n_blocks * block_size, device=meta.context_lens.device)
    hidden = positions[None, :] >= meta.context_lens[:, None]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
    return replace(meta, key_bias=bias.view(batch, 1, 1, -1))


def with_block_mask(meta: DecodeMetadata, block_size: int, num_blocks: int) -> DecodeMetadata:
    """`meta` with the FlexAttention block mask of its sequences over a cache of `num_blocks` blocks.

    The sparse part lists each sequence's first `ceil(context_len / block_size)` table entries, so the kernel
    visits only those blocks. The mask function alone defines the same mask (as FlexAttention requires): a
    [batch, num_blocks] table maps each physical block to its index in the sequence's table (-1 if absent), and a
    slot is visible when its block belongs to the sequence and its position is below the context length.
    """
    from torch.nn.attention.flex_attention import BlockMask

    batch, n_blocks = meta.block_tables.shape
    lengths = meta.context_lens
    device = lengths.device
    used = (lengths + block_size - 1) // block_size
    logical = torch.full((batch, num_blocks), -1, dtype=torch.int32, device=device)
    positions = torch.arange(n_blocks, dtype=torch.int32, device=device).expand(batch, n_blocks)
    # entries past `used` (the scratch block, padding the table) scatter -1; a block used by the sequence appears
    # once among its used entries, so the maximum is its index: deterministic where padding repeats a block
    positions = torch.where(positions < used.view(batch, 1), positions, -1)
    logical.scatter_reduce_(1, meta.block_tables.long(), positions, reduce="amax")

    def visible(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        index = logical[b, kv_idx // block_size]
        return (index >= 0) & (index * block_size + kv_idx % block_size < lengths[b])

    mask = BlockMask.from_kv_blocks(
        used.to(torch.int32).view(batch, 1, 1),
        meta.block_tables.to(torch.int32).view(batch, 1, 1, n_blocks),
        BLOCK_SIZE=(_QUERY_BLOCK, block_size),
        mask_mod=visible,
        seq_lengths=(1, num_blocks * block_size),
        compute_q_blocks=False,
    )
    return replace(meta, block_mask=mask)


_QUERY_BLOCK = 128
"""The block mask's query-block size (one decode query per sequence sits in the first block)."""

_FLEX: dict[bool, Callable[..., torch.Tensor]] = {}


def _flex_attention(compiled: bool) -> Callable[..., torch.Tensor]:
    """flex_attention, compiled for CUDA once per process (one compilation per batch bucket of the decode step)."""
    if compiled not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        if compiled:
            import torch._dynamo

            # one graph per decode batch bucket: raise dynamo's per-function recompilation limit to cover them all
            # (`cache_size_limit` in the torch releases before it was renamed)
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, limit, max(getattr(config, limit), 64))
            _FLEX[compiled] = torch.compile(flex_attention, dynamic=False, fullgraph=True)
        else:
            _FLEX[compiled] = flex_attention
    return _FLEX[compiled]


def write_kv(
    layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, kv_scale: float = 1.0
) -> None:
    """Stores keys/values `[T, kv_heads, head_dim]` at `slot_mapping` [T] of `layer_cache` [2, NB, BS, KVH, D]
    (an FP8 cache: as `to_cache` rounds them)."""
    kv_heads, head_dim = layer_cache.shape[-2:]
    cache = _raw(layer_cache)
    quantize = _TO_CACHE if k.is_cuda and layer_cache.dtype == FP8_CACHE_DTYPE else _to_cache_pair
    for index, stored in enumerate(quantize(k, v, layer_cache.dtype, kv_scale)):
        cache[index].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, _raw(stored))


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies blocks `src` [N] onto blocks `dst` [N] in every layer, keys and values (copy-on-write)."""
    raw = _raw(cache)
    raw[:, :, dst] = raw[:, :, src]


def _to_padded(x: torch.Tensor, meta: PrefillMetadata) -> torch.Tensor:
    """[T, heads, D] packed -> [batch, heads, max_len, D] padded with zeros."""
    out = x.new_zeros(meta.batch_size * meta.max_len, *x.shape[1:])
    out.index_copy_(0, meta.pad_index, x)
    return out.view(meta.batch_size, meta.max_len, *x.shape[1:]).transpose(1, 2)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    meta: PrefillMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens, within `window` (None: all earlier ones), with a sink
    logit per head (`sinks` [heads], None: none; `sinks_windows`).

    q, k: [T, heads / kv_heads, D]; v: [T, kv_heads, Dv] (packed, sequence after sequence). Returns
    [T, heads, Dv].
    """
    group, heads, value_dim = q.shape[1] // k.shape[1], q.shape[1], v.shape[-1]
    if sinks is not None:
        q, k, v = with_sink_dims(q, sinks, scale), with_zero_dims(k), with_zero_dims(v)
    qp = _to_padded(q, meta)
    kp = _to_padded(k, meta).repeat_interleave(group, dim=1)
    vp = _to_padded(v, meta).repeat_interleave(group, dim=1)
    length = meta.max_len
    visible = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    if window is not None:
        visible &= window_visible(length, window, q.device)
    mask = visible[None, None] & meta.key_valid[:, None, None, :]
    if sinks is not None:
        kp, vp, mask = append_sink_key(kp, vp, mask)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2).reshape(meta.batch_size * length, heads, v.shape[-1])
    return out.index_select(0, meta.pad_index)[..., :value_dim]


def decode_attention(
    q: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached tokens (the new one written before this call), within `window`
    (None: all of them), with a sink logit per head (`sinks` [heads]), through the Triton kernel when
    `meta.triton`, FlexAttention when `meta` has a block mask (neither windows nor sinks), else SDPA over the
    gathered blocks.

    q: [B, heads, D]; layer_cache: [2, NB, BS, kv_heads, D]. Returns [B, heads, D].
    """
    if meta.triton:
        return paged_decode_attention(
            q,
            layer_cache,
            meta.block_tables,
            meta.context_lens,
            scale,
            kv_scale=meta.kv_scale,
            window=window,
            sinks=sinks,
        )
    if meta.block_mask is not None:
        if layer_cache.dtype == FP8_CACHE_DTYPE:
            raise ValueError(
                "FlexAttention decode does not read an FP8 KV cache; use decode_attention triton or gather"
            )
        if window is not None or sinks is not None:
            raise ValueError("FlexAttention decode implements no sliding window or attention sinks")
        return _flex_decode(q, layer_cache, meta, scale)
    batch, heads, head_dim = q.shape
    block_size, kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    n_blocks = meta.block_tables.shape[1]
    length = n_blocks * block_size
    flat_blocks = meta.block_tables.reshape(-1)
    raw = _raw(layer_cache)
    k, v = (
        from_cache(raw[i].index_select(0, flat_blocks).view(layer_cache.dtype), q.dtype, meta.kv_scale)
        .view(batch, length, kv_heads, head_dim)
        .transpose(1, 2)
        for i in (0, 1)
    )
    if meta.key_bias is None:
        meta = with_key_bias(meta, block_size, q.dtype)
    bias = meta.key_bias
    if window is not None:
        bias = bias + window_key_bias(meta.context_lens, length, window, q.dtype)
    if sinks is not None:
        q, k, v = with_sink_dims(q, sinks, scale), with_zero_dims(k), with_zero_dims(v)
        k, v, bias = append_sink_key(k, v, bias)
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, q.shape[-1])
    out = F.scaled_dot_product_attention(grouped_q, k, v, attn_mask=bias, scale=scale)
    return out.reshape(batch, heads, -1)[..., :head_dim]


def _flex_decode(q: torch.Tensor, layer_cache: torch.Tensor, meta: DecodeMetadata, scale: float) -> torch.Tensor:
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = layer_cache.shape[3]
    # the layer's cache as one sequence of slots [1, kv_heads, slots, D] (strided views, nothing copied)
    keys = layer_cache[0].view(-1, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    values = layer_cache[1].view(-1, kv_heads, head_dim).transpose(0, 1).unsqueeze(0)
    flex = _flex_attention(compiled=q.is_cuda)
    out = flex(q.unsqueeze(2), keys, values, block_mask=meta.block_mask, scale=scale, enable_gqa=heads != kv_heads)
    return out.squeeze(2)
