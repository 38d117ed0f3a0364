"""The shared decoder (Llama, Mistral, Qwen2, Qwen3; Mixtral, Qwen2-MoE, Qwen3-MoE, GLM-4.5, DeepSeek-V3, GPT-OSS)
and its weight loader.

Layout follows the inference convention: a batch is a flat run of tokens `[T]` with their positions, and the
attention metadata says how tokens group into sequences and where they live in the paged KV cache
(`attention.py`). Numerics follow transformers' modules (float32 RMSNorm statistics, float32 rotary tables cast
to the activation dtype, float32 router softmax), so an fp32 engine reproduces an fp32 HF model to rounding; in
bf16 the fused RMSNorm rounds once where transformers rounds twice. The pointwise steps (rotary embedding, SiLU
gating, residual add + RMSNorm, the add deferred into the next layer's first norm) are `pointwise.PointwiseOps`:
eager, or compiled into fused kernels (the engine's choice on CUDA); decode passes through the Triton decode
kernel rotate q and k and write the cache in one kernel (`triton_rope`; not for models with per-head q/k norms;
`fused_rope` off: the separate steps). Logits come out in the model's dtype. DeepSeek-V3's multi-latent attention
(`mla.LatentAttention`) replaces `Attention` in every layer, with a cache of compressed latents (`cache_entry`).

Mixture of experts (`SparseMoe`): a router, `route` (softmax over all experts, or sigmoid scores with an expert
score bias and group-limited top-k; top-k, optional renormalisation and scaling), the routed experts (`Experts`),
then a shared expert (sigmoid-gated or not) where there is one. The routed experts run through one of two paths
over the same stacked `experts.gate_up_proj` [E, 2F, H] / `experts.down_proj` [E, H, F] parameters (the
`moe_kernel`): `routed_experts`, the simple exact one, which sorts the (token, expert) pairs by expert and runs
each routed expert's gated MLP on its own rows, adding the weighted outputs in transformers' order (one host sync
per layer for the per-expert row counts, a few kernels per active expert: the CPU reference, and the engine's
choice on CPU); or the fast one (`fused_moe`): the pairs sorted by expert on the device and a grouped GEMM over
the sorted rows with on-device offsets (a Triton kernel in the style of vLLM's fused MoE, or `torch._grouped_mm`),
sync-free and so captured in the decode CUDA graphs as a dense model's step is. Routing, shared experts, expert
biases and the clamped activation (`MoeSpec.expert_mlp_bias`, `swiglu_limit`: GPT-OSS's) are the same on both.
`record_routing` makes every pass copy each token's chosen expert ids into a buffer (a fixed one, so the copy is
captured in decode graphs too): rollout routing replay.

A hybrid model (Qwen3.5, Qwen3.5 MoE, Qwen3-Next) runs Gated DeltaNet (`gated_delta.GatedDeltaNet`, registered as
HF's `linear_attn`) in place of `self_attn` on the layers `layer_types` marks `linear_attention`: the KV cache holds
the attention layers only (`cache_index`: each layer's index in the KV cache or in the state cache), the linear
layers read and write their states in the pass's state slots (`forward`'s `states`, `meta.linear`). Its attention
layers gate their output (`Attention.gated`: q_proj's per-head gate rows, sigmoid, before `o_proj`).

Tensor parallelism (a `tp_group.TensorParallel`, built from a given process group; None: one device and not a
single collective or extra op): the layers are megatron-core's column- and row-parallel ones. `qkv_proj` holds this
rank's q heads and its KV heads (replicated when there are fewer KV heads than ranks), `gate_up_proj` its columns
of gate and of up; `o_proj` and `down_proj` take its input columns and their outputs are summed over the group
before the residual add (`RowLinear`, the bias added once after the sum). Experts are split by expert tensor
parallelism: every rank holds every expert, a slice of its width, routes every token alike (the router is whole
on each rank) and sums the combined routed plus shared expert output once. The embedding is vocabulary-parallel
(other ranks' ids give zero rows, then a sum), and the output layer computes this rank's vocabulary block for the
sampled rows only, all-gathered into the full logits, identical on every rank. The per-rank widths and the slice of
each HF tensor a rank keeps come from `tp_shards`. Expert parallelism (experts split over ranks) is not
implemented.

Weights: parameters are created empty and filled only through `load_weights`, which takes HF names and full
(unsharded) tensors in any order and in any number of calls (under tensor parallelism each rank copies its slice,
`Target.shard`), by the type of the architecture's table entry that names them (`arch.layer_entries`,
`arch.engine_param`): `{q,k,v}_proj` go into row slices of `qkv_proj`, `{gate,up}_proj` into `gate_up_proj`, and
each expert's tensors (HF's per-expert names) into slice `[expert]` of the stacked `experts.gate_up_proj` /
`experts.down_proj`; a transformers-5 model's fused in-memory expert tensors (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`, Mixtral's `mlp.gate.weight`) are split into those per-expert names first
(`arch.fused_expert_pieces`), so `load_weights(hf_model.named_parameters())` works for every architecture. Copies
are in place, so a refit keeps every parameter's storage (and any CUDA graph captured over it) valid.
`check_loaded` names whatever has not been loaded since the weights were (re)allocated.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from hf_mcore_bridge.checkpoint.expert_parts import take
from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.engine.arch import (
    FusedPiece,
    engine_param,
    fused_expert_pieces,
    fused_linear_projections,
    ignored_names,
    ignored_prefixes,
    layer_entries,
    layer_window,
    router_module,
    shared_expert_module,
)
from hf_mcore_bridge.engine.attention import (
    DecodeMetadata,
    PrefillMetadata,
    decode_attention,
    prefill_attention,
    with_block_mask,
    with_key_bias,
    write_kv,
)
from hf_mcore_bridge.engine.expert_sort import check_sort
from hf_mcore_bridge.engine.fused_moe import (
    SILU,
    ExpertActivation,
    Tiles,
    fused_experts,
    gated_activation,
    grouped_mm_experts,
)
from hf_mcore_bridge.engine.gated_delta import GatedDeltaNet, LinearAttnSpec, linear_attn_shards
from hf_mcore_bridge.engine.layers import Linear, RMSNorm, RowLinear, empty_param
from hf_mcore_bridge.engine.mla import CACHE_HEADS, CACHE_PLANES, LatentAttention
from hf_mcore_bridge.engine.options import DECODE_KERNELS, MOE_KERNELS
from hf_mcore_bridge.engine.pointwise import EAGER_OPS, PointwiseOps
from hf_mcore_bridge.engine.state_cache import StateCache, StateShape
from hf_mcore_bridge.engine.tp_group import TensorParallel
from hf_mcore_bridge.engine.tp_shards import (
    LocalSizes,
    Sections,
    Shard,
    TPRank,
    column_shard,
    head_shard,
    kv_shard,
    local_sizes,
    vocab_shard,
)
from hf_mcore_bridge.engine.triton_rope import fused_rope_write
from hf_mcore_bridge.models.mapping_types import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    Entry,
    FusedGateUp,
    FusedQKV,
    GatedQKV,
    LayerKind,
    Size,
    is_expert,
)
from hf_mcore_bridge.models.moe import HF_GROUP_SCORE_TOPK, MoeSpec
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec, RopeSpec

AttentionMetadata = PrefillMetadata | DecodeMetadata

ONE_DEVICE = TPRank(1, 0)
"""The place of a model without tensor parallelism."""

_COPY_BATCH = 64
_COPY_BATCH_BYTES = 256 << 20
"""`load_weights` copies up to `_COPY_BATCH` tensors or this many bytes at a time (one `_foreach_copy_`); the
caller's tensors are held until then, so a stream read lazily (from safetensors) keeps at most that much."""


_MEMCPY_BYTES = 1 << 20
"""`load_weights` copies a tensor of at least this many bytes on its own (`copy_`, a device memcpy) when source and
destination are contiguous with the same dtype and device; smaller tensors (norms, biases), whose cost is the
launches, and any needing a conversion go through the batched multi-tensor copy."""


def _memcpy_eligible(dest: torch.Tensor, src: torch.Tensor) -> bool:
    return dest.dtype == src.dtype and dest.device == src.device and dest.is_contiguous() and src.is_contiguous()


class MissingWeightsError(RuntimeError):
    """Some engine parameters were never filled by `load_weights`."""


class UnknownWeightError(KeyError):
    """`load_weights` got an HF name the model has no place for."""


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """[head_dim / 2] float32 inverse frequencies, computed with transformers' float32 op order. `head_dim` is the
    rotated width (`RopeSpec.rotary_dim` of a partial rotary embedding)."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * torch.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeSpec, dim: int) -> torch.Tensor:
    """YaRN's inverse frequencies (transformers' `_compute_yarn_parameters`; the correction range's bounds rounded
    out to whole dimensions with `truncate`, GPT-OSS's without): those of
    more than `beta_fast` rotations over the original context kept, of fewer than `beta_slow` divided by `factor`,
    a linear ramp between."""

    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32) - low) / ((high + 0.001 if low == high else high) - low), 0, 1
    )
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor


def rope_tables(inv_freq: torch.Tensor, num_positions: int, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [num_positions, head_dim] float32 (each frequency twice, as in `rotate_half` layout), times
    `scale` (YaRN's concentration, `RopeSpec.attention_scaling`)."""
    positions = torch.arange(num_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


class Embedding(nn.Module):
    """The token embedding; under tensor parallelism the rank's block of vocabulary rows, ids outside it give zero
    rows, and the blocks are summed over the group (megatron-core's `VocabParallelEmbedding`)."""

    def __init__(
        self,
        num: int,
        dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        tp: TensorParallel | None = None,
        start: int = 0,
        held: int = 0,
    ) -> None:
        super().__init__()
        self.weight = empty_param(num, dim, dtype=dtype, device=device)
        self.tp, self.start, self.held = tp, start, held

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.held)
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(h)


class Attention(nn.Module):
    """Attention over this rank's q heads and KV heads (all of them without tensor parallelism)."""

    def __init__(
        self,
        cfg: ModelSpec,
        sizes: LocalSizes,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: PointwiseOps = EAGER_OPS,
        tp: TensorParallel | None = None,
        window: int | None = None,
    ) -> None:
        super().__init__()
        self.ops = ops
        self.window = window
        """The layer's sliding window (`arch.layer_window`); None: every earlier position."""
        self.num_heads, self.num_kv_heads, self.head_dim = sizes.num_heads, sizes.num_kv_heads, cfg.head_dim
        q_rows, kv_rows = sizes.num_heads * cfg.head_dim, sizes.num_kv_heads * cfg.head_dim
        self.split = (q_rows, kv_rows, kv_rows)
        self.gated = cfg.attention_output_gate
        """The output is gated per head (Qwen3.5, Qwen3-Next): `qkv_proj`'s q part holds per head its query rows,
        then its gate's (HF `q_proj`'s order); the output is multiplied by sigmoid(gate) before `o_proj`."""
        self.scale = cfg.softmax_scale
        gate_rows = q_rows if self.gated else 0
        self.qkv_proj = Linear(cfg.hidden_size, gate_rows + sum(self.split), cfg.qkv_bias, dtype, device)
        self.o_proj = RowLinear(q_rows, cfg.hidden_size, cfg.o_bias, dtype, device, tp)
        offset = cfg.norm_offset
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_epsilon, dtype, device, offset) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_epsilon, dtype, device, offset) if cfg.qk_norm else None
        self.sinks = empty_param(sizes.num_heads, dtype=dtype, device=device) if cfg.attention_sinks else None
        """This rank's heads' sink logits (GPT-OSS's `self_attn.sinks`); None: no sinks."""

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        tokens = x.shape[0]
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        gate = None
        if self.gated:
            both, kv = qkv.split((2 * self.split[0], self.split[1] + self.split[2]), dim=-1)
            query, gate = both.view(tokens, heads, 2, head_dim).unbind(2)
            qkv = torch.cat([query.reshape(tokens, -1), kv], dim=-1)
            gate = gate.reshape(tokens, -1)
        if isinstance(meta, DecodeMetadata) and meta.fused_rope and self.q_norm is None and gate is None:
            # one kernel rotates q and k and writes k and v into the cache (`triton_rope`)
            q = fused_rope_write(qkv, cos, sin, layer_cache, meta.slot_mapping, heads, kv_heads, meta.kv_scale)
            out = decode_attention(q, layer_cache, meta, self.scale, self.window, self.sinks)
            return self.o_proj(out.reshape(tokens, -1))
        v = qkv[:, self.split[0] + self.split[1] :].view(tokens, kv_heads, head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k, _ = qkv.split(self.split, dim=-1)
            q = self.q_norm(q.view(tokens, heads, head_dim))
            k = self.k_norm(k.view(tokens, kv_heads, head_dim))
            q, k = self.ops.rope(q, cos, sin), self.ops.rope(k, cos, sin)
        else:
            # Without per-head norms q and k are rotated together: half the kernels of the decode step's RoPE.
            qk = qkv[:, : self.split[0] + self.split[1]].view(tokens, heads + kv_heads, head_dim)
            q, k = self.ops.rope(qk, cos, sin).split((heads, kv_heads), dim=1)
        write_kv(layer_cache, k, v, meta.slot_mapping, meta.kv_scale)
        if isinstance(meta, PrefillMetadata):
            out = prefill_attention(q, k, v, meta, self.scale, self.window, self.sinks)
        else:
            out = decode_attention(q, layer_cache, meta, self.scale, self.window, self.sinks)
        out = out.reshape(tokens, -1)
        return self.o_proj(out if gate is None else out * torch.sigmoid(gate))


class MLP(nn.Module):
    """A gated MLP (SiLU, or GeGLU with the tanh approximation: `activation`, HF `hidden_act`) with fused gate and up
    projections (`width`: this rank's columns of each); `reduce`: the group its row-parallel down projection sums
    over (None: no sum, the caller's or no tensor parallelism)."""

    def __init__(
        self,
        hidden: int,
        width: int,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: PointwiseOps = EAGER_OPS,
        reduce: TensorParallel | None = None,
        activation: str = "silu",
    ) -> None:
        super().__init__()
        self.gated = ops.gelu_tanh_mul if activation == "gelu_pytorch_tanh" else ops.silu_mul
        self.gate_up_proj = Linear(hidden, 2 * width, False, dtype, device)
        self.down_proj = RowLinear(width, hidden, False, dtype, device, reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gated(self.gate_up_proj(x)))


def routing_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer dtype that holds expert ids below `num_experts`: uint8 up to 256 experts, else int16."""
    if num_experts > 1 << 15:
        raise ValueError(f"{num_experts} experts: expert ids are recorded as int16 at most")
    return torch.uint8 if num_experts <= 256 else torch.int16


def route(
    router_logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    *,
    score_function: str = "softmax",
    expert_bias: torch.Tensor | None = None,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 weights [T, k] and expert ids [T, k] of each token's top-k experts. router_logits: [T, E].

    - `softmax` (Mixtral, Qwen-MoE): scores softmax(logits) over all experts in float32; the top-k scores, divided
      by their sum with `renormalize` (`norm_topk_prob`), else kept as they are.
    - `sigmoid` (GLM-4.5, DeepSeek-V3): scores s = sigmoid(logits) in float32, each expert on its own; the experts
      are chosen by s + `expert_bias` (float32 [E], `e_score_correction_bias`; it never enters the weights); with
      `num_groups`, only within each token's `group_topk` groups of largest group score, the sum of a group's
      `HF_GROUP_SCORE_TOPK` (2) largest biased scores (transformers' rule; megatron-core's equals it wherever
      conversion accepts the config); the weights are the chosen experts' s, divided by their sum + 1e-20 with
      `renormalize`.
    Then every weight is multiplied by `scaling_factor` (`routed_scaling_factor`).
    """
    if score_function == "softmax":
        if expert_bias is not None:
            raise ValueError("an expert score bias needs sigmoid scores")
        scores = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
        choice = scores
    elif score_function == "sigmoid":
        scores = torch.sigmoid(router_logits.float())
        choice = scores if expert_bias is None else scores + expert_bias.float()
    else:
        raise ValueError(f"unknown router score function {score_function!r}")
    if num_groups is not None and group_topk is not None:
        choice = _within_best_groups(choice, num_groups, group_topk)
    experts = torch.topk(choice, top_k, dim=-1)[1]
    weights = scores.gather(-1, experts)
    if renormalize:
        total = weights.sum(dim=-1, keepdim=True)
        weights = weights / (total + 1e-20 if score_function == "sigmoid" else total)
    if scaling_factor != 1.0:
        weights = weights * scaling_factor
    return weights, experts


def _within_best_groups(choice: torch.Tensor, num_groups: int, group_topk: int) -> torch.Tensor:
    """`choice` [T, E] with every expert outside each token's `group_topk` best groups set to -inf."""
    tokens, experts = choice.shape
    grouped = choice.view(tokens, num_groups, experts // num_groups)
    group_scores = grouped.topk(HF_GROUP_SCORE_TOPK, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, group_topk, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    return grouped.masked_fill(~allowed[..., None], float("-inf")).view(tokens, experts)


def routed_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:
    """Sum over each token's experts of weight * (down(act(gate_up(x) + gate_up_bias)) + down_bias); [T, H] in x's
    dtype. The exact path (and the CPU reference of `fused_moe`).

    x: [T, H]; w13: [E, 2F, H] (gate rows, then up rows); w2: [E, H, F]; weights, experts: [T, k]; the optional
    biases [E, 2F] and [E, H]; `activation`: silu(gate) * up or the clamped one (`fused_moe.ExpertActivation`).
    The token rows are grouped by expert with one stable sort and each expert runs once on its rows;
    contributions are added in ascending expert order, as transformers does. Costs one host sync (the per-expert
    row counts).
    """
    out = torch.zeros_like(x)
    top_k = experts.shape[1]
    flat_experts = experts.flatten()
    flat_weights = weights.flatten()
    order = torch.argsort(flat_experts, stable=True)
    counts = torch.bincount(flat_experts, minlength=w13.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        tokens = rows // top_k
        b13 = gate_up_bias[expert] if gate_up_bias is not None else None
        b2 = down_bias[expert] if down_bias is not None else None
        y = F.linear(gated_activation(F.linear(x[tokens], w13[expert], b13), activation), w2[expert], b2)
        out.index_add_(0, tokens, (y * flat_weights[rows, None]).to(out.dtype))
    return out


class Experts(nn.Module):
    """Routed experts stacked on a leading expert axis, under transformers 5's names: `gate_up_proj` [E, 2F, H]
    (gate rows, then up rows) and `down_proj` [E, H, F] (F: this rank's slice of every expert's width under tensor
    parallelism); with `MoeSpec.expert_mlp_bias`, `gate_up_proj_bias` [E, 2F] and `down_proj_bias` [E, H]
    (GPT-OSS's names; the down bias is added by the first tensor-parallel rank only, `adds_down_bias`, since the
    ranks' outputs are summed).

    `kernel` (`options.MOE_KERNELS`): `exact`, the per-expert loop (`routed_experts`), or the sorted grouped GEMM
    through Triton (`fused_moe.fused_experts`; `tiles`: its tile, None: `fused_moe.default_tiles`) or
    `torch._grouped_mm` (`fused_moe.grouped_mm_experts`), both free of host syncs and so capturable in a graph;
    `sort` (`options.MOE_SORTS`): how those two sort the pairs by expert (`expert_sort.sort_experts`: `torch`, the
    default, or one Triton kernel, opt-in until timed on a GPU; the exact path ignores it)."""

    def __init__(
        self,
        moe: MoeSpec,
        width: int,
        hidden: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kernel: str = "exact",
        adds_down_bias: bool = True,
        sort: str = "torch",
    ) -> None:
        super().__init__()
        if kernel not in MOE_KERNELS:
            raise ValueError(f"moe_kernel must be one of {', '.join(MOE_KERNELS)}, got {kernel!r}")
        check_sort(sort)
        self.gate_up_proj = empty_param(moe.num_experts, 2 * width, hidden, dtype=dtype, device=device)
        self.down_proj = empty_param(moe.num_experts, hidden, width, dtype=dtype, device=device)
        biased = moe.expert_mlp_bias
        self.gate_up_proj_bias = empty_param(moe.num_experts, 2 * width, dtype=dtype, device=device) if biased else None
        self.down_proj_bias = empty_param(moe.num_experts, hidden, dtype=dtype, device=device) if biased else None
        self.activation = ExpertActivation(moe.swiglu_limit, moe.swiglu_alpha)
        self.kernel = kernel
        self.sort = sort
        self.adds_down_bias = adds_down_bias
        self.tiles: Tiles | None = None
        """The Triton kernel's tile (None: `fused_moe.default_tiles` for the pass's number of pairs)."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        down_bias = self.down_proj_bias if self.adds_down_bias else None
        options = dict(gate_up_bias=self.gate_up_proj_bias, down_bias=down_bias, activation=self.activation)
        if self.kernel == "exact":
            return routed_experts(x, self.gate_up_proj, self.down_proj, weights, experts, **options)
        options["sort"] = self.sort
        if self.kernel == "triton":
            return fused_experts(x, self.gate_up_proj, self.down_proj, weights, experts, tiles=self.tiles, **options)
        return grouped_mm_experts(x, self.gate_up_proj, self.down_proj, weights, experts, **options)


class Router(nn.Module):
    """A MoE layer's router (HF `mlp.gate`; GPT-OSS's `mlp.router`): `weight` [E, H] in the model's dtype, with
    `MoeSpec.router_bias` a `bias` [E] added to the logits, and, for biased routing, `e_score_correction_bias` [E]
    in float32 (as transformers and megatron-core hold it). Logits in the model's dtype, or in float32 from float32
    copies of input and weight (`MoeSpec.router_fp32`)."""

    def __init__(self, moe: MoeSpec, hidden: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = empty_param(moe.num_experts, hidden, dtype=dtype, device=device)
        self.bias = empty_param(moe.num_experts, dtype=dtype, device=device) if moe.router_bias else None
        self.e_score_correction_bias = (
            empty_param(moe.num_experts, dtype=torch.float32, device=device) if moe.expert_bias else None
        )
        self.fp32 = moe.router_fp32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp32:
            return F.linear(x.float(), self.weight.float(), None if self.bias is None else self.bias.float())
        return F.linear(x, self.weight, self.bias)


class SparseMoe(nn.Module):
    """Router (`gate`), routed experts and, where the architecture has one, a shared expert (sigmoid-gated, as
    Qwen2-MoE's, or added as it is, as GLM-4.5's), registered under the table's name for it (`shared_expert`,
    `shared_experts`: `arch.shared_expert_module`).

    Under tensor parallelism the router and the shared expert's gate are whole on every rank (so every rank routes
    alike), the routed and shared experts hold this rank's slice of their widths, and the rank's partial output of
    both is summed over the group once, after they are combined."""

    def __init__(
        self,
        cfg: ModelSpec,
        sizes: LocalSizes,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: PointwiseOps = EAGER_OPS,
        tp: TensorParallel | None = None,
        moe_kernel: str = "exact",
        moe_sort: str = "torch",
    ) -> None:
        super().__init__()
        assert cfg.moe is not None and sizes.expert_width is not None
        self.moe = cfg.moe
        self.round_routing_weights = cfg.arch.round_routing_weights
        self.tp = tp
        moe = cfg.moe
        self.router_name = router_module(cfg)
        self.add_module(self.router_name, Router(moe, cfg.hidden_size, dtype, device))
        first_rank = tp is None or tp.place.rank == 0
        self.experts = Experts(
            moe, sizes.expert_width, cfg.hidden_size, dtype, device, moe_kernel, first_rank, sort=moe_sort
        )
        shared = sizes.shared_expert_width
        self.shared_name = shared_expert_module(cfg) if shared is not None else None
        if self.shared_name is not None and shared is not None:
            self.add_module(self.shared_name, MLP(cfg.hidden_size, shared, dtype, device, ops))
        gated = shared is not None and moe.shared_expert_gate
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, False, dtype, device) if gated else None
        self.routing_out: torch.Tensor | None = None
        """Where the pass writes each token's chosen expert ids ([rows, k], rows >= the pass's tokens), set by
        `CausalLM.record_routing`; None: not recorded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe = self.moe
        router: Router = self._modules[self.router_name]  # type: ignore[assignment]
        weights, experts = route(
            router(x),
            moe.topk,
            moe.renormalize,
            score_function=moe.score_function,
            expert_bias=router.e_score_correction_bias,
            num_groups=moe.num_groups,
            group_topk=moe.group_topk,
            scaling_factor=moe.topk_scaling_factor or 1.0,
        )
        if self.routing_out is not None:  # a copy into a fixed buffer: also inside a captured decode graph
            self.routing_out[: experts.shape[0]].copy_(experts)
        if self.round_routing_weights:
            weights = weights.to(x.dtype)
        out = self.experts(x, weights, experts)
        if self.shared_name is not None:
            shared = self._modules[self.shared_name](x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out if self.tp is None else self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelSpec,
        sizes: LocalSizes,
        mlp: LayerKind,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: PointwiseOps = EAGER_OPS,
        tp: TensorParallel | None = None,
        moe_kernel: str = "exact",
        moe_sort: str = "torch",
        window: int | None = None,
        linear: LinearAttnSpec | None = None,
        place: TPRank = ONE_DEVICE,
    ) -> None:
        super().__init__()
        self.ops = ops
        hidden, eps, offset = cfg.hidden_size, cfg.norm_epsilon, cfg.norm_offset
        self.input_layernorm = RMSNorm(hidden, eps, dtype, device, offset)
        self.linear_attn = GatedDeltaNet(linear, place, dtype, device, tp) if linear is not None else None
        """A Gated DeltaNet layer (`linear`: its sizes) in place of `self_attn`: its states live in the state cache."""
        if self.linear_attn is None:
            self.self_attn: nn.Module = (
                Attention(cfg, sizes, dtype, device, ops, tp, window)
                if cfg.mla is None
                else LatentAttention(cfg, sizes.num_heads, dtype, device, ops, tp)
            )
        # Llama's post-attention norm is the MLP's input norm; with post-norms (Gemma) it norms the attention's
        # output, and the MLP has its own pre- and post-norms
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, device, offset)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device, offset) if cfg.post_norms else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, device, offset) if cfg.post_norms else None
        self.local_rope = window is not None and cfg.sliding_rope is not None
        """Whether the layer rotates by the sliding layers' own RoPE table (`ModelSpec.sliding_rope`: Gemma 3)."""
        self.mlp: nn.Module = (
            SparseMoe(cfg, sizes, dtype, device, ops, tp, moe_kernel, moe_sort)
            if mlp is LayerKind.MOE
            else MLP(hidden, sizes.intermediate_size, dtype, device, ops, tp, cfg.hidden_act)
        )

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        layer_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream before it). h: the previous layer's MLP output, added to `residual` here
        (fused with the norm that follows); at the first layer the embeddings, with `residual` None. `layer_cache`:
        the layer's KV cache, or a Gated DeltaNet layer's (conv, recurrent) states (`StateCache.layer`)."""
        norm = self.input_layernorm
        if residual is None:
            residual, x = h, norm(h)
        else:
            x, residual = self.ops.add_rms_norm(h, residual, norm.scale, norm.eps)
        if self.linear_attn is not None:
            assert isinstance(layer_cache, tuple) and meta.linear is not None, "a hybrid pass needs its state slots"
            h = self.linear_attn(x, meta.linear, *layer_cache)
        else:
            h = self.self_attn(x, cos, sin, layer_cache, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            norm = self.post_attention_layernorm
            x, residual = self.ops.add_rms_norm(h, residual, norm.scale, norm.eps)
            return self.mlp(x), residual
        norm = self.pre_feedforward_layernorm
        x, residual = self.ops.add_rms_norm(self.post_attention_layernorm(h), residual, norm.scale, norm.eps)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Backbone(nn.Module):
    def __init__(
        self,
        cfg: ModelSpec,
        sizes: LocalSizes,
        dtype: torch.dtype,
        device: torch.device | str,
        ops: PointwiseOps = EAGER_OPS,
        tp: TensorParallel | None = None,
        moe_kernel: str = "exact",
        moe_sort: str = "torch",
        place: TPRank = ONE_DEVICE,
    ) -> None:
        super().__init__()
        linear = linear_attn_spec(cfg)
        self.embed_tokens = Embedding(
            sizes.vocab_rows, cfg.hidden_size, dtype, device, tp, sizes.vocab_start, sizes.vocab_held
        )
        self.layers = nn.ModuleList(
            DecoderLayer(
                cfg,
                sizes,
                cfg.layer_kind(layer),
                dtype,
                device,
                ops,
                tp,
                moe_kernel,
                moe_sort,
                layer_window(cfg, layer),
                linear if layer_type(cfg, layer) == LINEAR_ATTENTION else None,
                place,
            )
            for layer in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_epsilon, dtype, device, cfg.norm_offset)


def layer_type(cfg: ModelSpec, layer: int) -> str:
    """The `layer_types` kind of decoder layer `layer` (full attention where the model lists none)."""
    return cfg.layer_types[layer] if cfg.layer_types else FULL_ATTENTION


def linear_attn_spec(cfg: ModelSpec) -> LinearAttnSpec | None:
    """The sizes of a hybrid model's Gated DeltaNet layers, their input projections split (Qwen3.5) or fused per key
    head (Qwen3-Next); None without such layers."""
    linear = cfg.linear_attention
    if linear is None:
        return None
    return LinearAttnSpec(
        hidden_size=cfg.hidden_size,
        num_k_heads=linear.num_key_heads,
        num_v_heads=linear.num_value_heads,
        head_k_dim=linear.key_head_dim,
        head_v_dim=linear.value_head_dim,
        conv_kernel=linear.conv_kernel,
        eps=cfg.norm_epsilon,
        fused_projections=fused_linear_projections(cfg),
    )


LORA_B = ".lora_b"
"""The suffix of a linear's LoRA B parameter (`layers.Linear.lora_b`, `engine.lora`)."""


@dataclass(frozen=True)
class Target:
    """Where one HF tensor goes: a parameter, its slice `[expert]` (stacked experts), then rows of that."""

    param: str
    rows: tuple[int, int] | None = None
    """None: all rows."""
    expert: int | None = None
    """The index on the leading expert axis; None for a parameter that is not stacked over experts."""
    shard: Shard | Sections | None = None
    """This tensor-parallel rank's part of the full HF tensor; None: all of it (also without tensor parallelism)."""
    cols: tuple[int, int] | None = None
    """Columns of those rows (a LoRA B's rank columns in its linear's `lora_b`, `engine.lora`); None: all."""


class CausalLM(nn.Module):
    """The decoder plus output layer; parameter names are HF's, except the fused `qkv_proj` / `gate_up_proj`."""

    def __init__(
        self,
        cfg: ModelSpec,
        dtype: torch.dtype,
        device: torch.device | str,
        max_positions: int,
        decode_kernel: str = "gather",
        flex_min_batch: int = 1,
        ops: PointwiseOps = EAGER_OPS,
        tp: TensorParallel | None = None,
        moe_kernel: str = "exact",
        moe_sort: str = "torch",
    ):
        super().__init__()
        if decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {decode_kernel!r}")
        self.cfg = cfg
        self.decode_kernel = decode_kernel
        self.flex_min_batch = flex_min_batch
        """With the `flex` kernel, decode passes of fewer rows use `gather` (see `EngineConfig.flex_min_batch`)."""
        self.ops = ops
        """The pointwise steps (`pointwise.EAGER_OPS`, or `pointwise.compiled_ops()` for fused kernels)."""
        self.tp = tp
        """The tensor-parallel group's collectives; None: one device, no collective (`TensorParallel.of`)."""
        self.fused_rope = True
        """With the Triton decode kernel, rotate q and k and write the cache in one kernel (`triton_rope`); set by
        the engine (`EngineConfig.fused_rope`)."""
        self.kv_scale = 1.0
        """Per-tensor scale of an FP8 KV cache's entries (`attention.to_cache`), set by the engine; passed to the
        attention of every layer through the pass's metadata."""
        place = tp.place if tp is not None else ONE_DEVICE
        moe = cfg.moe
        self.sizes = local_sizes(
            cfg.num_attention_heads,
            cfg.num_query_groups,
            cfg.ffn_hidden_size,
            moe.ffn_hidden_size if moe is not None else None,
            moe.shared_expert_size if moe is not None else None,
            cfg.vocab_size,
            place,
        )
        """This rank's head counts and widths (the model's own without tensor parallelism)."""
        self.moe_kernel = moe_kernel
        """The routed experts' kernel (`options.MOE_KERNELS`; `Experts`): `exact` syncs with the host once per MoE
        layer, the others never, so only they let a MoE model's decode step be captured in a CUDA graph."""
        self.moe_sort = moe_sort
        """How the fast MoE kernels sort the pairs by expert (`options.MOE_SORTS`; `Experts`)."""
        self.model = Backbone(cfg, self.sizes, dtype, device, ops, tp, moe_kernel, moe_sort, place)
        self.linear = linear_attn_spec(cfg)
        """The full sizes of a hybrid model's Gated DeltaNet layers; None without them."""
        linear_layers = [layer_type(cfg, i) == LINEAR_ATTENTION for i in range(cfg.num_layers)]
        self.cache_index = [linear_layers[:i].count(lin) for i, lin in enumerate(linear_layers)]
        """Per decoder layer its index in the KV cache (full and sliding attention layers, in order) or, for a
        Gated DeltaNet layer, in the state cache (linear layers, in order)."""
        self.num_kv_layers = cfg.num_layers - sum(linear_layers)
        """Layers with a KV cache (a hybrid model's full-attention layers only)."""
        self.num_linear_layers = sum(linear_layers)
        self.place = place
        self.lm_head = (
            self.model.embed_tokens
            if cfg.tie_word_embeddings
            else Linear(cfg.hidden_size, self.sizes.vocab_rows, False, dtype, device)
        )
        inv_freq = rope_inv_freq(cfg.rope, cfg.rotary_dim)
        cos, sin = rope_tables(inv_freq, max_positions, cfg.rope.attention_scaling)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        local = cfg.sliding_rope
        if local is not None:  # the sliding layers' own table (Gemma 3's `rope_local_base_freq`)
            cos, sin = rope_tables(rope_inv_freq(local, local.rotary_dim(cfg.head_dim)), max_positions)
        self.register_buffer("local_rope_cos", cos.to(device) if local is not None else None, persistent=False)
        self.register_buffer("local_rope_sin", sin.to(device) if local is not None else None, persistent=False)
        self.embedding_scale = math.sqrt(cfg.hidden_size) if cfg.embedding_scale else None
        """What the embeddings are multiplied by, rounded to their dtype (Gemma's sqrt(hidden_size)); None: 1."""
        self._shapes = {name: tuple(p.shape) for name, p in self.named_parameters()}
        self.targets = _expand_targets(cfg, self.sizes, place, self._shapes)
        self.ignored = _expand(ignored_names(cfg), cfg.num_layers)
        self.ignored_prefixes = ignored_prefixes(cfg)
        """HF name prefixes skipped on load: multi-token-prediction layers (`arch.ignored_prefixes`)."""
        self.fused = {
            name: pieces
            for name, pieces in fused_expert_pieces(cfg).items()
            if name not in self.targets and all(piece.name in self.targets for piece in pieces)
        }
        """transformers-5 fused expert name -> the per-expert HF names it is split into by `load_weights`."""
        self.loaded: set[str] = set()
        self.weights_version = 0
        """Incremented whenever the parameters' storage is released or reallocated (they keep it otherwise)."""
        self._views: dict[str, torch.Tensor] = {}
        """HF name -> its storage view, resolved once per allocation of the weights (a refit looks each up)."""
        filled = {t.param for t in self.targets.values()}
        if filled != set(self._shapes):
            raise AssertionError(
                f"weight table and parameters disagree: table only {sorted(filled - set(self._shapes))}, "
                f"parameters only {sorted(set(self._shapes) - filled)}"
            )

    def record_routing(self, rows: int) -> torch.Tensor:
        """From now on every forward pass writes each token's chosen experts in every MoE layer into the returned
        buffer `[moe_layers, rows, k]` (`routing_dtype`; row t: the pass's token t; `rows` must cover the largest
        pass, padded decode rows included), which the caller reads after the pass."""
        moe = self.cfg.moe
        if moe is None:
            raise ValueError(f"{self.cfg.architecture} has no mixture-of-experts layers: no routing to record")
        layers = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoe)]
        device = self.rope_cos.device
        buffer = torch.zeros(len(layers), rows, moe.topk, dtype=routing_dtype(moe.num_experts), device=device)
        for index, layer in enumerate(layers):
            layer.routing_out = buffer[index]
        return buffer

    def state_shape(self, conv_dtype: torch.dtype) -> StateShape | None:
        """This rank's per-sequence states of the Gated DeltaNet layers (`state_cache`); None without them."""
        if self.linear is None:
            return None
        local = self.linear.local(self.place)
        return StateShape(
            self.num_linear_layers,
            local.conv_dim,
            local.conv_kernel,
            local.num_v_heads,
            local.head_k_dim,
            local.head_v_dim,
            conv_dtype,
        )

    @property
    def cache_entry(self) -> tuple[int, int, int]:
        """(planes, heads, width) of one token's entry in a layer's KV cache (`attention.allocate_kv_cache`): keys
        and values of this rank's KV heads, (2, kv_heads, head_dim); a multi-latent model's latent and rotary key,
        (1, 1, kv_lora_rank + qk_rope_head_dim)."""
        if self.cfg.mla is not None:
            return CACHE_PLANES, CACHE_HEADS, self.cfg.mla.cache_width
        return 2, self.sizes.num_kv_heads, self.cfg.head_dim

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        logits_rows: torch.Tensor | None = None,
        states: StateCache | None = None,
    ) -> torch.Tensor:
        """Logits [N, vocab] in the model's dtype for the rows `logits_rows` of the flat batch (every row when None);
        the sampler upcasts them to float32 as it reads them (no float32 copy of the [N, vocab] logits is written).

        input_ids, positions: [T]; kv_cache: [kv layers, planes, NB, BS, heads, D] (`cache_entry`; a hybrid model's
        attention layers only, `cache_index`); states: a hybrid model's Gated DeltaNet states (read and written in
        the slots `meta.linear` names).
        """
        h = self.model.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            h = h * torch.tensor(self.embedding_scale, dtype=h.dtype)
        if self.kv_scale != meta.kv_scale:
            meta = replace(meta, kv_scale=self.kv_scale)
        if isinstance(meta, DecodeMetadata):  # per-pass attention inputs, shared by every layer
            if self.decode_kernel == "triton":
                meta = replace(meta, triton=True, fused_rope=self.fused_rope)
            elif self.decode_kernel == "flex" and meta.block_tables.shape[0] >= self.flex_min_batch:
                meta = with_block_mask(meta, kv_cache.shape[3], kv_cache.shape[2])
            else:
                meta = with_key_bias(meta, kv_cache.shape[3], h.dtype)
        cos = self.rope_cos.index_select(0, positions).to(h.dtype)
        sin = self.rope_sin.index_select(0, positions).to(h.dtype)
        local = (cos, sin)
        if self.local_rope_cos is not None and self.local_rope_sin is not None:
            local = (
                self.local_rope_cos.index_select(0, positions).to(h.dtype),
                self.local_rope_sin.index_select(0, positions).to(h.dtype),
            )
        residual = None
        for index, layer in enumerate(self.model.layers):
            layer_cos, layer_sin = local if layer.local_rope else (cos, sin)
            if layer.linear_attn is not None:
                assert states is not None, "a hybrid model's pass needs its state cache"
                layer_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor] = states.layer(self.cache_index[index])
            else:
                layer_cache = kv_cache[self.cache_index[index]]
            h, residual = layer(h, residual, layer_cos, layer_sin, layer_cache, meta)
        norm = self.model.norm
        h = norm(h) if residual is None else self.ops.add_rms_norm(h, residual, norm.scale, norm.eps)[0]
        if logits_rows is not None:
            h = h.index_select(0, logits_rows)
        logits = F.linear(h, self.lm_head.weight)
        return logits if self.tp is None else self.tp.gather_vocab(logits, self.cfg.vocab_size)

    @torch.no_grad()
    def quantize_fp8(self) -> None:
        """Per-block FP8 copies of the attention and dense MLP projections (`engine.fp8`), from the weights held
        now; embeddings, norms, router, experts and the output layer stay in the model's dtype."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.qkv_proj.quantize_fp8()
                module.o_proj.quantize_fp8()
            elif isinstance(module, MLP):
                module.gate_up_proj.quantize_fp8()
                module.down_proj.quantize_fp8()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], parts: bool = False) -> set[str]:
        """Copies HF-named full tensors into place (under tensor parallelism, this rank's part of each); returns the
        HF names loaded by this call (per-expert names for a fused transformers-5 expert tensor). `parts`: a
        tensor of the shape of this rank's part is that part (e.g. a trainer's own tensor-parallel shard, already
        in HF terms) and is copied as it is; full tensors are still sliced.

        Raises `UnknownWeightError` for a name the model has no place for and `ValueError` for a shape mismatch.
        """
        done: set[str] = set()
        dests: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        held = 0
        for name, tensor in self._split_fused(weights):
            if name not in self.targets:
                if name in self.ignored or (self.ignored_prefixes and name.startswith(self.ignored_prefixes)):
                    continue
                close = difflib.get_close_matches(name, list(self.targets), n=3)
                raise UnknownWeightError(f"unknown weight {name!r}; closest known names: {close}")
            dest = self.hf_view(name)
            shard = self.targets[name].shard
            if shard is not None and not (parts and tensor.shape == dest.shape):
                full, tensor = tensor, shard.take(tensor, name)
                if dest.shape != tensor.shape:
                    expected = shard.full_shape(tuple(dest.shape))
                    raise ValueError(f"{name}: expected shape {expected}, got {tuple(full.shape)}")
            if dest.shape != tensor.shape:
                raise ValueError(f"{name}: expected shape {tuple(dest.shape)}, got {tuple(tensor.shape)}")
            done.add(name)
            nbytes = tensor.numel() * tensor.element_size()
            if nbytes >= _MEMCPY_BYTES and _memcpy_eligible(dest, tensor):
                dest.copy_(tensor)  # a device memcpy
                continue
            dests.append(dest)
            sources.append(tensor)
            held += nbytes
            if len(dests) == _COPY_BATCH or held >= _COPY_BATCH_BYTES:
                torch._foreach_copy_(dests, sources)
                dests, sources, held = [], [], 0
        if dests:
            # one multi-tensor copy per batch instead of a kernel launch per tensor (it copies tensor by tensor
            # where dtypes, devices or layouts differ)
            torch._foreach_copy_(dests, sources)
        self.loaded |= done
        return done

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """`weights` with each fused transformers-5 expert tensor replaced by its per-expert views."""
        for name, tensor in weights:
            pieces = self.fused.get(name)
            if pieces is None:
                yield name, tensor
                continue
            experts = self.cfg.moe.num_experts if self.cfg.moe is not None else 0
            if pieces[0].expert is not None and (tensor.dim() < 2 or tensor.shape[0] != experts):
                raise ValueError(f"{name}: expected {experts} experts on dim 0, got shape {tuple(tensor.shape)}")
            for piece in pieces:
                yield piece.name, _piece_of(tensor, piece)

    def hf_view(self, hf_name: str) -> torch.Tensor:
        """The engine's storage of one HF tensor: a whole parameter, or a view of its expert slice and rows."""
        view = self._views.get(hf_name)
        if view is None:
            target = self.targets[hf_name]
            data = self.get_parameter(target.param).data
            if target.expert is not None:
                data = data[target.expert]
            view = data if target.rows is None else data[target.rows[0] : target.rows[1]]
            view = view if target.cols is None else view[:, target.cols[0] : target.cols[1]]
            self._views[hf_name] = view
        return view

    def missing_weights(self) -> list[str]:
        """HF names not loaded since the weights were last allocated."""
        return sorted(set(self.targets) - self.loaded)

    def check_loaded(self) -> None:
        """Raises `MissingWeightsError` naming every HF tensor that was never loaded."""
        missing = self.missing_weights()
        if missing:
            shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
            raise MissingWeightsError(f"weights never loaded: {shown}")

    def release_weights(self) -> None:
        """Frees every parameter's storage (shapes are kept); `allocate_weights` brings empty ones back."""
        for _, p in self.named_parameters():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.loaded.clear()
        self._views.clear()
        self.weights_version += 1

    def allocate_weights(self) -> None:
        """Fresh, uninitialised storage for every parameter; all of them must be loaded again."""
        for name, p in self.named_parameters():
            # a LoRA B's entries outside its projections' blocks are never loaded: they stay zero (`engine.lora`)
            fresh = torch.zeros if name.endswith(LORA_B) else torch.empty
            p.data = fresh(self._shapes[name], dtype=p.dtype, device=p.device)
        self.loaded.clear()
        self._views.clear()
        self.weights_version += 1


def _piece_of(fused: torch.Tensor, piece: FusedPiece) -> torch.Tensor:
    """One expert's tensor inside a fused `[num_experts, ...]` tensor: a view for `all`, `gate`, `up`; otherwise
    (GPT-OSS's interleaved, transposed parts) a copy cut as `expert_parts.take` cuts it."""
    tensor = fused if piece.expert is None else fused[piece.expert]
    if piece.part == "all":
        return tensor
    if piece.part in ("gate", "up"):
        half = tensor.shape[0] // 2
        return tensor[:half] if piece.part == "gate" else tensor[half:]
    return take(tensor, piece.part)


def _expand(templates: Iterable[str], num_layers: int) -> set[str]:
    out: set[str] = set()
    for template in templates:
        layers = range(num_layers) if "{layer}" in template else (0,)
        out |= {template.format(layer=layer) for layer in layers}
    return out


def _expand_targets(
    cfg: ModelSpec, sizes: LocalSizes, tp: TPRank, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Target]:
    """HF name -> target, for every layer and expert (the table's placeholders filled in); `shapes`: the engine
    parameters' (this rank's) shapes."""
    targets: dict[str, Target] = {}
    kinds = {
        (kind, layer_type(cfg, layer)) for kind in (LayerKind.DENSE, LayerKind.MOE) for layer in range(cfg.num_layers)
    }
    entries = {(kind, attention): layer_entries(cfg, kind, attention) for kind, attention in kinds}
    for layer in range(cfg.num_layers):
        for entry in entries[(cfg.layer_kind(layer), layer_type(cfg, layer))]:
            targets.update(_entry_targets(cfg, sizes, tp, shapes, entry, layer))
    if tp.size == 1:  # one device: every tensor whole, nothing narrowed on load
        targets = {name: replace(target, shard=None) for name, target in targets.items()}
    return targets


def _entry_targets(
    cfg: ModelSpec,
    sizes: LocalSizes,
    tp: TPRank,
    shapes: dict[str, tuple[int, ...]],
    entry: Entry,
    layer: int,
) -> dict[str, Target]:
    """The targets of one table entry in one layer (model-level entries come out the same for every layer), by the
    entry's type: q/k/v rows of `qkv_proj`, gate/up rows of `gate_up_proj`, a routed expert's slice of a stacked
    parameter, or one whole parameter (`Direct`, `RotaryRows`: split by rows or columns under tensor
    parallelism as its style says)."""
    if any(is_expert(name) for name in entry.hf_sources):
        return _expert_targets(cfg, tp, shapes, entry, layer)
    if any(LINEAR_ATTN in name for name in entry.hf_sources):
        return _linear_attn_targets(cfg, tp, entry, layer)
    param = fill(engine_param(cfg.arch, entry), layer)
    if isinstance(entry, FusedQKV | GatedQKV):
        per_head = cfg.head_dim * (2 if isinstance(entry, GatedQKV) else 1)  # a gated head: query rows, gate rows
        q_rows, kv_rows = sizes.num_heads * per_head, sizes.num_kv_heads * cfg.head_dim
        q = head_shard(cfg.num_attention_heads, per_head, tp)
        kv = kv_shard(cfg.num_query_groups, cfg.head_dim, tp)
        return {
            fill(entry.q, layer): Target(param, (0, q_rows), shard=q),
            fill(entry.k, layer): Target(param, (q_rows, q_rows + kv_rows), shard=kv),
            fill(entry.v, layer): Target(param, (q_rows + kv_rows, q_rows + 2 * kv_rows), shard=kv),
        }
    if isinstance(entry, FusedGateUp):
        shard = column_shard(_width(cfg, entry.width), tp, param)
        return {
            fill(entry.gate, layer): Target(param, (0, shard.size), shard=shard),
            fill(entry.up, layer): Target(param, (shard.size, 2 * shard.size), shard=shard),
        }
    (name,) = entry.hf_sources
    if entry.parallel is Parallel.VOCAB:
        shard = vocab_shard(cfg.vocab_size, tp)
        return {fill(name, layer): Target(param, (0, shard.size), shard=shard)}
    if entry.parallel is Parallel.COLUMN and len(shapes[param]) == 2:
        return {fill(name, layer): Target(param, shard=_column_rows(cfg, entry, shapes[param], tp))}
    return {fill(name, layer): Target(param, shard=_row_shard(entry.parallel, shapes[param], tp))}


LINEAR_ATTN = ".linear_attn."
"""Where a Gated DeltaNet layer's HF tensors live (`GatedDeltaNet`'s parameters carry their HF names)."""


def _linear_attn_targets(cfg: ModelSpec, tp: TPRank, entry: Entry, layer: int) -> dict[str, Target]:
    """Each HF tensor of a Gated DeltaNet entry fills the parameter of its name, the rank keeping its key heads'
    sections (`gated_delta.linear_attn_shards`: q, k and v rows each split, so a sectioned shard)."""
    linear = linear_attn_spec(cfg)
    assert linear is not None, f"{entry.hf_sources}: a Gated DeltaNet entry in a model without linear attention"
    shards = linear_attn_shards(linear, tp)
    targets = {}
    for name in entry.hf_sources:
        pieces = shards[name.split(LINEAR_ATTN, 1)[1]]
        shard = Sections(pieces) if len(pieces) > 1 else pieces[0] if pieces else None
        targets[fill(name, layer)] = Target(fill(name, layer), shard=shard)
    return targets


def _column_rows(cfg: ModelSpec, entry: Entry, local_shape: tuple[int, ...], tp: TPRank) -> Shard | None:
    """The rank's output rows of a whole column-parallel matrix: an equal block of them (multi-latent attention's
    up-projections, per head), or None where the engine builds the matrix whole on every rank (its
    down-projections, whose latent every rank's heads read)."""
    full = cfg.sizes()[entry.shape[0]]
    rows = local_shape[0]
    if rows == full:
        return None
    if rows * tp.size != full:
        raise AssertionError(f"{entry.hf_sources}: {rows} local rows of {full} at tensor-parallel size {tp.size}")
    return Shard(0, tp.rank * rows, rows, full)


def _width(cfg: ModelSpec, size: Size) -> int:
    """The full width (rows of gate and of up) of a gated MLP: dense, routed expert or shared expert."""
    width = cfg.sizes()[size]
    assert width is not None, f"{cfg.architecture} has no {size.value}"
    return width


def _row_shard(parallel: Parallel, local_shape: tuple[int, ...], tp: TPRank) -> Shard | None:
    """The rank's input columns (last dim) of a row-parallel tensor whose local shape is `local_shape`; None for a
    replicated one."""
    if parallel is Parallel.REPLICATED or tp.size == 1:
        return None
    if parallel is Parallel.COLUMN and len(local_shape) == 1:  # one value per query head (sinks)
        return Shard(0, tp.rank * local_shape[0], local_shape[0], tp.size * local_shape[0])
    if parallel is not Parallel.ROW:
        raise AssertionError(f"unexpected parallel style {parallel} for a whole-parameter entry")
    width = local_shape[-1]
    return Shard(len(local_shape) - 1, tp.rank * width, width, tp.size * width)


def _expert_targets(
    cfg: ModelSpec,
    tp: TPRank,
    shapes: dict[str, tuple[int, ...]],
    entry: Entry,
    layer: int,
) -> dict[str, Target]:
    """One target per expert, in slice `[expert]` of the stacked parameter (gate rows, then up rows, of a
    `FusedGateUp`; the whole slice, split by columns as its style says, of a `Direct`)."""
    assert cfg.moe is not None
    param = fill(engine_param(cfg.arch, entry), layer)
    targets: dict[str, Target] = {}
    for expert in range(cfg.moe.num_experts):
        if isinstance(entry, FusedGateUp):
            shard = column_shard(_width(cfg, entry.width), tp, param)
            targets[fill(entry.gate, layer, expert)] = Target(param, (0, shard.size), expert, shard)
            targets[fill(entry.up, layer, expert)] = Target(param, (shard.size, 2 * shard.size), expert, shard)
        else:
            (name,) = entry.hf_sources
            shard = _row_shard(entry.parallel, shapes[param][1:], tp)
            targets[fill(name, layer, expert)] = Target(param, expert=expert, shard=shard)
    return targets
