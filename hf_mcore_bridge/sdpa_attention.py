"""Core attention for megatron-core through torch's `scaled_dot_product_attention`, and the layer specs using it.

megatron-core's local spec (the one available without Transformer Engine) computes attention unfused: it
materialises the full `[b, heads, s, s]` score matrix and cannot take packed sequences. `SDPAttention` is a
drop-in `core_attention` module: the same inputs (`[s, b, heads, head_dim]` query/key/value, megatron's boolean
mask where True means masked) and output (`[s, b, heads * head_dim]`), computed by SDPA, which dispatches to
flash / memory-efficient kernels on GPU. Packed sequences (`PackedSeqParams`, `qkv_format="thd"`, as
megatron-core's attention hands them: `[t, heads, head_dim]` with RoPE already applied per sequence) are
attended with a block-diagonal causal mask, so no sequence sees another.

Assumes no attention bias, no learnable softmax offset and no context parallelism (as the local spec does).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


def block_causal_mask(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    """`[total, total]` boolean mask, True where a token may attend: same sequence and not in the future."""
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    segment = torch.bucketize(torch.arange(total, device=device), bounds[1:], right=True)
    starts = bounds[segment]
    positions = torch.arange(total, device=device)
    same = segment[:, None] == segment[None, :]
    return same & (positions[None, :] <= positions[:, None]) & (positions[None, :] >= starts[:, None])


class SDPAttention(MegatronModule):
    """megatron-core `core_attention` computed by `torch.nn.functional.scaled_dot_product_attention`."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
    ):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("SDPAttention does not implement context parallelism")
        self.attn_mask_type = attn_mask_type
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("SDPAttention does not take an attention bias")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._packed(query, key, value, packed_seq_params)
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
        mask_type = attn_mask_type or self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal
        allowed = None if attention_mask is None else ~attention_mask
        out = self._attend(q, k, v, allowed, causal)
        seq, batch = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(seq, batch, -1)

    def _packed(self, query, key, value, params: PackedSeqParams) -> torch.Tensor:
        """`[t, n, d]` packed sequences -> `[t, n * d]`, each sequence attending causally to itself only."""
        total = query.shape[0]
        allowed = block_causal_mask(params.cu_seqlens_q, total, query.device)
        q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query, key, value))
        out = self._attend(q, k, v, allowed, causal=False)
        return out.squeeze(0).permute(1, 0, 2).reshape(total, -1)

    def _attend(self, q, k, v, allowed: torch.Tensor | None, causal: bool) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if groups > 1:  # grouped-query attention: every backend takes repeated heads
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=self.softmax_scale,
        )


def use_sdpa(spec: object) -> object:
    """Put `SDPAttention` in as the core attention of a layer spec or of every layer of a block spec."""
    layer_specs = getattr(spec, "layer_specs", None) or [spec]
    for layer in layer_specs:
        layer.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec
