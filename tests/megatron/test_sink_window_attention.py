"""Attention sinks and sliding windows in the project's core attention (`SDPAttention`), one process: against
transformers' GPT-OSS attention (`eager_attention_forward` with its sliding-window mask), unpacked and packed
(a packed row gives each sequence what it gives alone, windows and sinks per sequence), and refused under context
parallelism."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnMaskType
from transformers.masking_utils import sliding_window_overlay
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

from hf_mcore_bridge.megatron.sdpa_attention import SDPAttention

HEADS, GROUPS, DIM, WINDOW = 4, 2, 8, 3


def _attention(window: bool, sinks: bool, cp: int = 1) -> SDPAttention:
    config = TransformerConfig(
        num_layers=2,
        hidden_size=HEADS * DIM,
        num_attention_heads=HEADS,
        num_query_groups=GROUPS,
        kv_channels=DIM,
        attention_dropout=0.0,
        softmax_type="learnable" if sinks else "vanilla",
        window_size=(WINDOW - 1, 0) if window else None,
        window_attn_skip_freq=[1, 0] if window else None,
        context_parallel_size=cp,
        use_cpu_initialization=True,
    )
    one = SimpleNamespace(size=lambda: 1)
    groups = SimpleNamespace(tp=one, cp=one if cp > 1 else None)
    attention = SDPAttention(config, 1, AttnMaskType.causal, "self", pg_collection=groups).eval()
    if sinks:
        with torch.no_grad():
            attention.softmax_offset.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    return attention


def _transformers(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """GPT-OSS's attention of one sequence: `[s, heads, d]` queries, `[s, groups, d]` keys/values; its window's mask
    from transformers' own overlay."""
    s = q.shape[0]
    inside = sliding_window_overlay(WINDOW)
    allowed = torch.tensor([[j <= i and bool(inside(0, 0, i, j)) for j in range(s)] for i in range(s)])
    mask = torch.zeros(s, s).masked_fill(~allowed, float("-inf"))
    module = SimpleNamespace(
        num_key_value_groups=HEADS // GROUPS,
        sinks=sinks if sinks is not None else torch.full((HEADS,), -1e9),
        training=False,
    )
    out, _ = eager_attention_forward(
        module, *(x.permute(1, 0, 2).unsqueeze(0) for x in (q, k, v)), mask, scaling=DIM**-0.5
    )
    return out[0]  # [s, heads, d]


def _qkv(length: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(length, n, DIM, generator=generator) for n in (HEADS, GROUPS, GROUPS))


def test_sinks_and_window_as_transformers_computes_them() -> None:
    q, k, v = _qkv(9, 0)
    attention = _attention(window=True, sinks=True)
    ours = attention(*(x.unsqueeze(1) for x in (q, k, v)), None).reshape(9, HEADS, DIM)
    expected = _transformers(q, k, v, attention.softmax_offset.detach())
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    # the comparison sees both: without the sinks, or without the window, transformers' attention differs
    assert (ours - _transformers(q, k, v, None)).abs().max() > 1e-2
    full = _attention(window=False, sinks=True)
    with torch.no_grad():
        full.softmax_offset.copy_(attention.softmax_offset)
    assert (full(*(x.unsqueeze(1) for x in (q, k, v)), None).reshape(9, HEADS, DIM) - ours).abs().max() > 1e-2


def test_a_packed_row_attends_each_sequence_alone() -> None:
    lengths = [5, 9, 2]
    pieces = [_qkv(n, i) for i, n in enumerate(lengths)]
    attention = _attention(window=True, sinks=True)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths)
    )
    row = attention(*(torch.cat([p[i] for p in pieces]) for i in range(3)), None, packed_seq_params=packed)
    alone = [attention(*(x.unsqueeze(1) for x in p), None).reshape(n, -1) for p, n in zip(pieces, lengths, strict=True)]
    torch.testing.assert_close(row, torch.cat(alone), rtol=0, atol=1e-6)


@pytest.mark.parametrize(("window", "sinks"), [(True, False), (False, True)])
def test_refused_under_context_parallelism(window: bool, sinks: bool) -> None:
    q, k, v = _qkv(4, 0)
    with pytest.raises(ValueError, match="context parallelism"):
        _attention(window=window, sinks=sinks, cp=2)(*(x.unsqueeze(1) for x in (q, k, v)), None)
