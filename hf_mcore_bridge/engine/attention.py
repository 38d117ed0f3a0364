"""Attention over the paged KV cache, through `torch.nn.functional.scaled_dot_product_attention` on any device.

Layout: the whole cache is one tensor `[layers, 2 (k, v), num_blocks, block_size, kv_heads, head_dim]`, so one
token's keys of one layer are a contiguous `[kv_heads, head_dim]` row addressed by a flat slot index
(`block * block_size + offset`), and a block copy (copy-on-write) is one indexed assignment over every layer.

Two attention shapes:
- prefill: each sequence of the batch attends only to its own fresh tokens (a prompt is computed once, with no
  cached context before it), so q, k, v are padded to `[batch, heads, max_len, head_dim]` and masked
  (causal within a sequence, padding keys hidden). Keys/values are also written into the cache.
- decode: one query token per sequence. Its keys/values are written to the cache, then the sequence's blocks are
  gathered through its block table into `[batch, kv_heads, n_blocks * block_size, head_dim]` and masked past the
  sequence's length. The gather is what a fused paged-attention kernel would avoid; it keeps this module plain
  torch. Grouped-query attention needs no key repetition here: the query heads of one KV head are folded into the
  query-length axis (`[batch, kv_heads, group, head_dim]`), which is exact because decode has no causal mask.
Every shape depends only on (batch, n_blocks), so the decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """The cache tensor `[layers, 2, num_blocks, block_size, kv_heads, head_dim]`, zero-filled."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, keys and values."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize


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
    pass by `with_key_bias` rather than once per layer."""


def with_key_bias(meta: DecodeMetadata, block_size: int, dtype: torch.dtype) -> DecodeMetadata:
    """`meta` with its additive key mask: keys at or past a sequence's length are hidden."""
    batch, n_blocks = meta.block_tables.shape
    positions = torch.arange(n_blocks * block_size, device=meta.context_lens.device)
    hidden = positions[None, :] >= meta.context_lens[:, None]
    bias = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill_(hidden, float("-inf"))
    return replace(meta, key_bias=bias.view(batch, 1, 1, -1))


def write_kv(layer_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores keys/values `[T, kv_heads, head_dim]` at `slot_mapping` [T] of `layer_cache` [2, NB, BS, KVH, D]."""
    kv_heads, head_dim = layer_cache.shape[-2:]
    layer_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    layer_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def copy_blocks(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """Copies blocks `src` [N] onto blocks `dst` [N] in every layer, keys and values (copy-on-write)."""
    cache[:, :, dst] = cache[:, :, src]


def _to_padded(x: torch.Tensor, meta: PrefillMetadata) -> torch.Tensor:
    """[T, heads, D] packed -> [batch, heads, max_len, D] padded with zeros."""
    out = x.new_zeros(meta.batch_size * meta.max_len, *x.shape[1:])
    out.index_copy_(0, meta.pad_index, x)
    return out.view(meta.batch_size, meta.max_len, *x.shape[1:]).transpose(1, 2)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: PrefillMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence over its own tokens.

    q: [T, heads, D]; k, v: [T, kv_heads, D] (packed, sequence after sequence). Returns [T, heads, D].
    """
    group = q.shape[1] // k.shape[1]
    qp = _to_padded(q, meta)
    kp = _to_padded(k, meta).repeat_interleave(group, dim=1)
    vp = _to_padded(v, meta).repeat_interleave(group, dim=1)
    length = meta.max_len
    causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril()
    mask = causal[None, None] & meta.key_valid[:, None, None, :]
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)
    out = out.transpose(1, 2).reshape(meta.batch_size * length, *q.shape[1:])
    return out.index_select(0, meta.pad_index)


def decode_attention(q: torch.Tensor, layer_cache: torch.Tensor, meta: DecodeMetadata, scale: float) -> torch.Tensor:
    """One query token per sequence over its cached tokens (the new one written before this call).

    q: [B, heads, D]; layer_cache: [2, NB, BS, kv_heads, D]. Returns [B, heads, D].
    """
    batch, heads, head_dim = q.shape
    block_size, kv_heads = layer_cache.shape[2], layer_cache.shape[3]
    n_blocks = meta.block_tables.shape[1]
    length = n_blocks * block_size
    flat_blocks = meta.block_tables.reshape(-1)
    k = layer_cache[0].index_select(0, flat_blocks).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = layer_cache[1].index_select(0, flat_blocks).view(batch, length, kv_heads, head_dim).transpose(1, 2)
    if meta.key_bias is None:
        meta = with_key_bias(meta, block_size, q.dtype)
    grouped_q = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    out = F.scaled_dot_product_attention(grouped_q, k, v, attn_mask=meta.key_bias, scale=scale)
    return out.reshape(batch, heads, head_dim)
