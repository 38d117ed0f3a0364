"""Sliding windows and attention sinks for the torch (SDPA) attention paths: prefill and `gather` decode.

A sliding window of W (per layer, `arch.layer_window`) lets a query at position p see keys at p - W + 1 .. p
(transformers' `sliding_window_overlay`): one more boolean condition in the prefill mask (`window_visible`), and in
decode an additive -inf over the keys before `context_len - W` (`window_key_bias`).

An attention sink (GPT-OSS's `self_attn.sinks`) is one learnable logit per query head that joins every softmax's
denominator and contributes no value: softmax([scores, sink])[:-1] @ V. SDPA takes no such logit, so it is given
as one extra key that every query sees, with a zero value: queries, keys and values get `SINK_PAD` more
dimensions, zero except the query's first extra one, which holds sink / scale, and the sink key's, which is 1; the
sink key's score is then scale * (sink / scale) * 1 = the sink (to rounding), every real key's score is unchanged
(its extra dimensions are zero), and the output's extra dimensions (zero) are dropped. The mask stays boolean and
[batch, 1, q, k], so no [batch, heads, q, k] bias is built; the pad keeps the head dimensions equal and a multiple
of 8, as the fused SDPA kernels want them. Costs one copy of q, k and v per layer.
"""

from __future__ import annotations

import torch

SINK_PAD = 8
"""Extra dimensions of queries and keys that carry the sink logit (a multiple of 8: the fused SDPA kernels' unit)."""


def with_sink_dims(q: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Queries [..., heads, D] -> [..., heads, D + SINK_PAD]: extra dimension 0 holds sinks [heads] / scale."""
    extra = q.new_zeros(*q.shape[:-1], SINK_PAD)
    extra[..., 0] = (sinks.float() / scale).to(q.dtype)
    return torch.cat((q, extra), dim=-1)


def with_zero_dims(k: torch.Tensor) -> torch.Tensor:
    """Keys or values [..., D] -> [..., D + SINK_PAD], the extra dimensions zero (scores and outputs unchanged)."""
    return torch.cat((k, k.new_zeros(*k.shape[:-1], SINK_PAD)), dim=-1)


def append_sink_key(
    k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys [B, H, L, D + SINK_PAD] and values [B, H, L, Dv + SINK_PAD] (`with_zero_dims`) and a mask [B, 1, Q, L]
    (boolean, or additive) with the sink key appended at L: key e_D, value 0, visible to every query."""
    batch, heads, _, width = k.shape
    key = k.new_zeros(batch, heads, 1, width)
    key[..., width - SINK_PAD] = 1
    value = v.new_zeros(batch, heads, 1, v.shape[-1])
    seen = torch.ones if visible.dtype == torch.bool else torch.zeros
    column = seen(*visible.shape[:-1], 1, dtype=visible.dtype, device=visible.device)
    return torch.cat((k, key), dim=2), torch.cat((v, value), dim=2), torch.cat((visible, column), dim=-1)


def window_visible(length: int, window: int, device: torch.device) -> torch.Tensor:
    """[length, length] bool: key j is inside query i's window (i - j < window; the causal condition apart)."""
    rows = torch.arange(length, device=device)
    return (rows[:, None] - rows[None, :]) < window


def window_key_bias(context_lens: torch.Tensor, slots: int, window: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, 1, 1, slots] additive mask of one decode query per sequence (at position context_len - 1): -inf on the
    keys before its window, 0 elsewhere (the keys past its length are the length mask's)."""
    positions = torch.arange(slots, device=context_lens.device)
    before = positions[None, :] < (context_lens - window)[:, None]
    bias = torch.zeros(before.shape, dtype=dtype, device=before.device).masked_fill_(before, float("-inf"))
    return bias.view(-1, 1, 1, slots)
