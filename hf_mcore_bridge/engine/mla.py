"""Multi-latent attention (DeepSeek-V3, Kimi-K2, Moonlight) over a KV cache of compressed latents.

Per token and layer the cache holds `kv_lora_rank + qk_rope_head_dim` values, never decompressed keys and values:
the normed key/value latent c_kv = kv_a_layernorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]) and the rotated key k_pe
(the projection's last `qk_rope_head_dim` rows), one key shared by every head. They sit in the paged block layout
of `attention.py`, one plane of one "head" of that width (DeepSeek-V3: 576 values a token and layer, where its
decompressed keys and values would take 128 heads * (192 + 128)).

The query: q_b_proj(q_a_layernorm(q_a_proj(x))), or one q_proj (Moonlight), per head `qk_nope_head_dim` plain dims
then `qk_rope_head_dim` rotary ones. RoPE pairs dims 2i, 2i + 1 where `rope_interleave` (DeepSeek's weights; done
as transformers' `apply_rotary_pos_emb_interleave` does, whose output lists the pairs' first then second
elements, for q and k alike), else rotate-half pairs. The softmax scale is qk_head_dim^-0.5, times
mscale(factor, mscale_all_dim)^2 under YaRN (`ModelSpec.softmax_scale`).

- Prefill decompresses, for the prompt's own causal attention only: kv_b_proj(c_kv) gives each head's
  [k_nope; v], its key is cat(k_nope, k_pe) and its query cat(q_nope, q_pe) (transformers' computation), through
  `attention.prefill_attention`; only the latent entries are written to the cache.
- Decode uses the absorbed projections, as DeepSeek's own inference does (`attn_impl="absorb"`): W_UK
  [heads, qk_nope_head_dim, kv_lora_rank] and W_UV [heads, v_head_dim, kv_lora_rank] are kv_b_proj's k and v rows
  of each head. q_nope . (W_UK c_kv) = (q_nope W_UK) . c_kv, so a head's score of cached token t is
  (q_latent . c_kv[t] + q_pe . k_pe[t]) * scale with q_latent = q_nope W_UK: attention of the query
  cat(q_latent, q_pe) over the cache entries themselves as keys and their latent part as values, one key/value
  head for all heads: a Triton kernel reading the blocks in place (`triton_mla`; the engine's choice on CUDA), or
  SDPA over the gathered blocks (the heads on the query axis, as `attention.decode_attention`'s `gather` folds
  grouped heads); its output, a latent per head, times W_UV^T gives the head's output, then o_proj.
  Equal to the decompressed attention up to rounding (float32: within 1e-5 in log-probs of transformers').
  W_UK and W_UV are views of kv_b_proj's weight, not copies: a load or refit (which copies into that storage in
  place) updates them with it, at no cost in memory, and they are taken afresh each pass (after `sleep(level=2)`
  reallocates the storage too).

Simplifications: FlexAttention reads no latent cache; the Triton kernel is a plain split-KV online softmax over
blocks of 16 heads (not FlashMLA's tuned pipeline); the cache is in
the activations' dtype (no FP8 latent cache); the MLA projections are not multiplied by FP8 copies under
`EngineConfig.fp8_weights`.

Tensor parallelism (vLLM's split): the heads split over the ranks (`q_b_proj` or `q_proj` and `kv_b_proj` by rows,
whole heads; `o_proj` by input columns, then an all-reduce), while the down-projections, the latent norms and the
latent cache are whole on every rank: every rank's heads read the whole latent. The cache is therefore not
divided by the TP size (each rank holds every token's 576 values, DeepSeek-V3), as in vLLM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_mcore_bridge.engine.attention import DecodeMetadata, PrefillMetadata, prefill_attention, with_key_bias
from hf_mcore_bridge.engine.layers import Linear, RMSNorm, RowLinear
from hf_mcore_bridge.engine.pointwise import EAGER_OPS, PointwiseOps
from hf_mcore_bridge.engine.tp_group import TensorParallel
from hf_mcore_bridge.engine.triton_mla import paged_mla_decode
from hf_mcore_bridge.models.spec import MlaSpec, ModelSpec

CACHE_PLANES = 1
"""Planes of a latent cache (`attention.allocate_kv_cache`): one entry per token, no separate keys and values."""
CACHE_HEADS = 1
"""Heads of a latent cache: the latent and the rotary key are shared by every query head."""


def write_latent(layer_cache: torch.Tensor, entries: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Stores `entries` [T, kv_lora_rank + qk_rope_head_dim] at `slot_mapping` [T] of one layer's latent cache
    [1, NB, BS, 1, width]."""
    layer_cache.view(-1, layer_cache.shape[-1]).index_copy_(0, slot_mapping, entries)


def gather_latent(layer_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Each sequence's cache entries through its block table: [B, n_blocks * block_size, width]."""
    batch, n_blocks = block_tables.shape
    block_size, width = layer_cache.shape[2], layer_cache.shape[-1]
    blocks = layer_cache[0].index_select(0, block_tables.reshape(-1))
    return blocks.view(batch, n_blocks * block_size, width)


def absorbed_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    layer_cache: torch.Tensor,
    meta: DecodeMetadata,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence over its cached latents, with the absorbed projections (module docstring).

    q_nope: [B, heads, qk_nope_head_dim]; q_pe: [B, heads, qk_rope_head_dim] (rotated); w_uk: [heads,
    qk_nope_head_dim, rank]; w_uv: [heads, v_head_dim, rank]; layer_cache: [1, NB, BS, 1, rank + rope].
    Returns [B, heads, v_head_dim].
    """
    rank = w_uk.shape[-1]
    q_latent = torch.einsum("bhd,hdc->bhc", q_nope, w_uk)
    if meta.triton:  # the blocks read in place (`triton_mla`)
        context = paged_mla_decode(
            q_latent.contiguous(), q_pe.contiguous(), layer_cache, meta.block_tables, meta.context_lens, scale
        )
        return torch.einsum("bhc,hvc->bhv", context, w_uv)
    query = torch.cat((q_latent, q_pe), dim=-1).unsqueeze(1)  # [B, 1 (KV head), heads, rank + rope]
    entries = gather_latent(layer_cache, meta.block_tables).unsqueeze(1)  # [B, 1, L, rank + rope]
    if meta.key_bias is None:
        meta = with_key_bias(meta, layer_cache.shape[2], q_nope.dtype)
    context = F.scaled_dot_product_attention(query, entries, entries[..., :rank], attn_mask=meta.key_bias, scale=scale)
    return torch.einsum("bhc,hvc->bhv", context.squeeze(1), w_uv)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """The rotary dims of `x` [..., R] as their pairs' first elements, then their second ones (dims 0, 2, ..., then
    1, 3, ...): interleaved-pair RoPE becomes rotate-half RoPE of the result (transformers' output order)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


class LatentAttention(nn.Module):
    """A layer's multi-latent attention; parameters under HF's names (`q_a_proj`, `q_a_layernorm`, `q_b_proj` or
    `q_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `o_proj`)."""

    def __init__(
        self,
        cfg: ModelSpec,
        num_heads: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: PointwiseOps = EAGER_OPS,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        assert cfg.mla is not None
        mla: MlaSpec = cfg.mla
        self.mla, self.ops, self.num_heads = mla, ops, num_heads
        self.softmax_scale = cfg.softmax_scale
        hidden, qk_head = cfg.hidden_size, mla.qk_nope_head_dim + mla.qk_rope_head_dim
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        self.q_proj: Linear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, False, dtype, device)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, cfg.latent_norm_eps, dtype, device)
            self.q_b_proj = Linear(mla.q_lora_rank, num_heads * qk_head, False, dtype, device)
        else:
            self.q_proj = Linear(hidden, num_heads * qk_head, False, dtype, device)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.cache_width, False, dtype, device)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, cfg.latent_norm_eps, dtype, device)
        kv_rows = num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = Linear(mla.kv_lora_rank, kv_rows, False, dtype, device)
        self.o_proj = RowLinear(num_heads * mla.v_head_dim, hidden, cfg.o_bias, dtype, device, tp)

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [heads, qk_nope_head_dim, rank], W_UV [heads, v_head_dim, rank]): views of kv_b_proj's weight."""
        mla = self.mla
        per_head = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        return per_head[:, : mla.qk_nope_head_dim], per_head[:, mla.qk_nope_head_dim :]

    def latent(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(normed c_kv [T, rank], unrotated k_pe [T, rope]) of the layer input x [T, hidden]."""
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split((self.mla.kv_lora_rank, self.mla.qk_rope_head_dim), dim=-1)
        return self.kv_a_layernorm(c_kv), k_pe

    def query(self, x: torch.Tensor) -> torch.Tensor:
        """[T, heads, qk_nope_head_dim + qk_rope_head_dim], before RoPE."""
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, -1)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE of the rotary dims x [T, heads, R] (interleaved pairs or rotate-half, `MlaSpec.rope_interleave`)."""
        return self.ops.rope(deinterleave(x) if self.mla.rope_interleave else x, cos, sin)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: PrefillMetadata | DecodeMetadata,
    ) -> torch.Tensor:
        mla, tokens = self.mla, x.shape[0]
        q_nope, q_pe = self.query(x).split((mla.qk_nope_head_dim, mla.qk_rope_head_dim), dim=-1)
        c_kv, k_pe = self.latent(x)
        q_pe, k_pe = self.rope(q_pe, cos, sin), self.rope(k_pe.unsqueeze(1), cos, sin)
        write_latent(layer_cache, torch.cat((c_kv, k_pe.squeeze(1)), dim=-1), meta.slot_mapping)
        if isinstance(meta, DecodeMetadata):
            w_uk, w_uv = self.absorbed()
            out = absorbed_decode(q_nope, q_pe, w_uk, w_uv, layer_cache, meta, self.softmax_scale)
        else:
            k_nope, v = (
                self.kv_b_proj(c_kv)
                .view(tokens, self.num_heads, -1)
                .split((mla.qk_nope_head_dim, mla.v_head_dim), dim=-1)
            )
            k = torch.cat((k_nope, k_pe.expand(tokens, self.num_heads, -1)), dim=-1)
            out = prefill_attention(torch.cat((q_nope, q_pe), dim=-1), k, v, meta, self.softmax_scale)
        return self.o_proj(out.reshape(tokens, -1))
