"""The engine's view of an architecture: the config its shared decoder is built from, and where each HF tensor goes.

Every supported architecture is the same pre-norm decoder (RMSNorm, rotary attention with grouped KV heads or
multi-latent attention, SiLU-gated MLP or a mixture of SiLU-gated experts). What differs lives in the
architecture's file in `mappings/` (`convert.architecture.Architecture`): its mapping table, its mixture-of-experts
reading (`moe_from_hf`, the same one conversion uses, so the engine routes exactly as the converted megatron-core
model does and refuses what conversion refuses), its optional parts (`qk_norm`, `qkv_bias` switches) and the few
decoder options the table does not say (`EngineOptions`: biases that HF configs switch on, how routing weights are
rounded, the latent norms' epsilon). Multi-latent attention is an architecture whose table has the key/value latent
(`Architecture.multi_latent`); its dimensions, YaRN and refusals come from conversion's own reading
(`config_bridge.from_hf`), and its tensors keep their HF names (`q_a_proj`, `kv_b_proj`, ...; `engine/mla.py`).
`ModelConfig.from_hf` reads an HF config (a `PretrainedConfig` or its dict) into the frozen `ModelConfig` the
decoder is built from, refusing values the decoder would get wrong.

`weight_table` is derived from the architecture's mapping table, not written again: each entry's HF names are
the names the engine loads, and its megatron-core name says which engine parameter they fill, through one
architecture-independent map (`ENGINE_PARAMS`: megatron-core's `linear_qkv` is the engine's `qkv_proj`, and so
on). The derived records: `Direct` copies a whole tensor, `FusedQKV` / `FusedGateUp` stack HF sources in row
order into the engine's fused `qkv_proj` / `gate_up_proj` (HF's own q, k, v order, unlike megatron-core's
interleaving), `ExpertSlice` / `ExpertGateUp` fill slice `[expert]` of a parameter stacked on a leading expert
axis (`experts.w2` [E, H, F]; `experts.w13` [E, 2F, H], gate rows then up rows). Each keeps the entry's
tensor-parallel style (`parallel_style.Parallel`). Biases an HF config switches on where the table has none
(Llama's `attention_bias`) get names derived from their weights'.

Simplifications and how to extend:
- Mixture of experts: softmax routing over all experts, then top-k (Mixtral, Qwen2-MoE, Qwen3-MoE), or sigmoid
  scores with a per-expert score bias, group-limited top-k and a scaling factor (GLM-4.5, DeepSeek-V3): one routing
  function, `model.route`, driven by `MoeConfig`. `router_jitter_noise` and the auxiliary load-balancing loss are
  training-only and ignored.
- Multi-token-prediction layers (`num_nextn_predict_layers`) are not used: their tensors are skipped on load
  (`ignored_prefixes`); the trainer's policy is built without them too (`convert.mtp`).
- Experts load from HF's per-expert names (the layout saved on the Hub) and from the fused in-memory names of a
  transformers-5 model (`mlp.experts.gate_up_proj` [E, 2F, H], gate rows then up rows; `mlp.experts.down_proj`
  [E, H, F]; Mixtral's router as `mlp.gate.weight`): `fused_expert_pieces` splits those into the per-expert names
  with the conversion's own rules (`Architecture.fused_experts`), so there is one name table.
- RoPE types: default, linear and llama3, each also partial (`partial_rotary_factor`: the first
  `int(head_dim * factor)` dimensions of each head rotate); DeepSeek's YaRN with multi-latent attention only (as
  conversion). Others (dynamic, longrope) are refused, not approximated.
- Sliding-window attention is not implemented; a config that would use it within `max_model_len` is refused.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.errors import UnsupportedArchitectureError
from hf_mcore_bridge.models import mapping_types as mt
from hf_mcore_bridge.models.architecture import Architecture, Bias
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.mapping_types import LayerKind, Size
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.registry import REGISTRY, for_config

ARCHITECTURES: Mapping[str, Architecture] = REGISTRY
"""The registry the engine serves: every architecture in `mappings/`."""


class MlpKind(enum.Enum):
    """Which MLP block a decoder layer has."""

    DENSE = "dense"
    """One SiLU-gated MLP of width `intermediate_size`."""
    MOE = "moe"
    """A router, routed experts stacked on a leading expert axis, and optionally a gated shared expert."""


def find_arch(hf: Mapping[str, Any]) -> Architecture:
    """The architecture of an HF config: by its `architectures` entry, else by its `model_type`."""
    try:
        return for_config(hf)
    except UnsupportedArchitectureError as err:
        raise NotImplementedError(str(err)) from None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters, normalised from either HF spelling."""

    theta: float
    """The base wavelength (`rope_theta`)."""
    rope_type: str = "default"
    """`default`, `linear`, `llama3`, or `yarn` (multi-latent attention only, as conversion reads it)."""
    factor: float = 1.0
    """The scaling factor (`linear`, `llama3`, `yarn`)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3, yarn: the context length the model was pre-trained with."""
    beta_fast: float = 32.0
    """yarn: frequencies of more than this many rotations over the original context are kept."""
    beta_slow: float = 1.0
    """yarn: frequencies of fewer than this many rotations are divided by `factor` (a linear ramp between)."""
    attention_factor: float = 1.0
    """yarn: the rotary concentration, mscale(factor, mscale) / mscale(factor, mscale_all_dim), multiplying the
    cos and sin tables (transformers' `attention_scaling`)."""
    partial_rotary_factor: float = 1.0
    """The fraction of each head's dimensions that rotate (the first `int(head_dim * factor)`; GLM-4.5: 0.5)."""

    def rotary_dim(self, head_dim: int) -> int:
        """The rotated dimensions of a head: the first `int(head_dim * partial_rotary_factor)`."""
        return int(head_dim * self.partial_rotary_factor)


@dataclass(frozen=True)
class MoeConfig:
    """The mixture of experts of a MoE model, read from an HF config."""

    num_experts: int
    """Routed experts per MoE layer (`num_experts`, or `num_local_experts` as Mixtral and transformers 5 save it)."""
    top_k: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    expert_width: int
    """Intermediate width of one routed expert."""
    renormalize: bool
    """The top-k routing weights are renormalised to sum to 1."""
    round_routing_weights: bool
    """Routing weights are rounded to the activation dtype before scaling the expert outputs."""
    shared_expert_width: int | None
    """Intermediate width of the shared expert; None when there is none."""
    layers: frozenset[int]
    """The layers with a MoE block; the others have a dense MLP of width `intermediate_size`."""
    shared_expert_gate: bool = True
    """The shared expert's output is scaled by sigmoid(x . w_gate) (Qwen2-MoE); False: added as it is (GLM-4.5)."""
    score_function: str = "softmax"
    """`softmax` over all experts, or an independent `sigmoid` per expert (GLM-4.5, DeepSeek-V3)."""
    expert_bias: bool = False
    """A float32 score bias per expert (`e_score_correction_bias`), added to the scores to choose the experts only."""
    num_groups: int | None = None
    """Group-limited routing: experts in this many groups, each token choosing within its `group_topk` best ones
    (ranked by the sum of their 2 largest biased scores); None: no groups."""
    group_topk: int | None = None
    """Group-limited routing: the groups each token may choose from."""
    scaling_factor: float = 1.0
    """The chosen experts' weights are multiplied by this (`routed_scaling_factor`)."""
    router_fp32: bool = False
    """Router logits from float32 copies of the input and weight (HF GLM-4.5 and DeepSeek-V3 route so)."""

    @classmethod
    def from_hf(cls, arch: Architecture, hf: Mapping[str, Any], num_layers: int) -> MoeConfig:
        """Read with the architecture's own `moe_from_hf` (the one conversion uses); its refusals are
        `ValueError`s here."""
        assert arch.moe_from_hf is not None
        try:
            moe = arch.moe_from_hf(hf, num_layers)
        except ConfigError as err:
            raise ValueError(str(err)) from None
        sigmoid = moe.score_function == "sigmoid"
        return cls(
            num_experts=moe.num_experts,
            top_k=moe.topk,
            expert_width=moe.ffn_hidden_size,
            # megatron-core renormalises sigmoid scores exactly when top-k > 1 (conversion refuses the rest)
            renormalize=moe.topk > 1 if sigmoid else not moe.pre_softmax,
            round_routing_weights=arch.engine.round_routing_weights,
            shared_expert_width=moe.shared_expert_size,
            layers=frozenset(i for i, routed in enumerate(moe.moe_layers) if routed),
            shared_expert_gate=moe.shared_expert_gate,
            score_function=moe.score_function,
            expert_bias=moe.expert_bias,
            num_groups=moe.num_groups,
            group_topk=moe.group_topk,
            scaling_factor=moe.topk_scaling_factor or 1.0,
            router_fp32=moe.router_fp32,
        )


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude scale: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MlaConfig:
    """Multi-latent attention (DeepSeek-V3): queries and keys/values through low-rank latents, read as conversion
    reads them (`config_bridge.MlaConfig`, its refusals included)."""

    q_lora_rank: int | None
    """Rank of the query's down-projection (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); None: one `q_proj`."""
    kv_lora_rank: int
    """Width of the compressed key/value latent c_kv, which the KV cache holds (normed) per token and layer."""
    qk_nope_head_dim: int
    """Query/key dims per head without RoPE (the key's from `kv_b_proj`)."""
    qk_rope_head_dim: int
    """Query/key dims per head with RoPE; the key's are one head shared by all (`kv_a_proj_with_mqa`'s last rows),
    cached beside the latent."""
    v_head_dim: int
    """Value dims per head (from `kv_b_proj`)."""
    rope_interleave: bool
    """RoPE pairs dims 2i, 2i + 1 (DeepSeek's weights, HF `rope_interleave=true`); False: rotate-half pairs."""
    softmax_scale: float
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' `yarn_apply_mscale`)."""
    latent_norm_eps: float
    """Epsilon of `q_a_layernorm` and `kv_a_layernorm` (`EngineOptions.latent_norm_eps`, else `rms_norm_eps`)."""

    @property
    def cache_width(self) -> int:
        """Values the KV cache holds per token and layer: the latent, then the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def read_mla(arch: Architecture, hf: Mapping[str, Any]) -> tuple[MlaConfig, RopeConfig]:
    """Multi-latent attention and its RoPE (plain or YaRN), through conversion's own reading of the config
    (`config_bridge.from_hf`: what conversion refuses is refused here, as `ValueError`s)."""
    try:
        read = config_bridge.from_hf(hf, arch)
    except ConfigError as err:
        raise ValueError(str(err)) from None
    mla, yarn = read.mla, read.yarn
    if mla is None:
        raise ValueError(f"{arch.hf_name} has multi-latent attention: the config needs kv_lora_rank")
    scale = (mla.qk_nope_head_dim + mla.qk_rope_head_dim) ** -0.5
    rope = RopeConfig(theta=read.rope_theta)
    if yarn is not None:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
        rope = RopeConfig(
            theta=read.rope_theta,
            rope_type="yarn",
            factor=yarn.factor,
            original_max_position_embeddings=yarn.original_max_position_embeddings,
            beta_fast=yarn.beta_fast,
            beta_slow=yarn.beta_slow,
            attention_factor=yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim),
        )
    eps = arch.engine.latent_norm_eps
    latent = MlaConfig(
        q_lora_rank=mla.q_lora_rank,
        kv_lora_rank=mla.kv_lora_rank,
        qk_nope_head_dim=mla.qk_nope_head_dim,
        qk_rope_head_dim=mla.qk_rope_head_dim,
        v_head_dim=mla.v_head_dim,
        rope_interleave=not mla.rotate_half,
        softmax_scale=scale,
        latent_norm_eps=float(eps if eps is not None else hf.get("rms_norm_eps", 1e-6)),
    )
    return latent, rope


@dataclass(frozen=True)
class ModelConfig:
    """Everything the shared decoder needs, read from an HF config."""

    arch: Architecture
    """The architecture (its file in `mappings/`)."""
    vocab_size: int
    """Rows of the embedding and of the output layer."""
    hidden_size: int
    """Width of the residual stream."""
    intermediate_size: int
    """Width of the gated MLP."""
    num_layers: int
    """Decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention when fewer than `num_heads`)."""
    head_dim: int
    """Width of one head (explicit in Qwen3 configs, else hidden_size // num_heads); with multi-latent attention
    the rotary width `qk_rope_head_dim` (as transformers' DeepseekV3Config sets it), the dims `rope` rotates."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope: RopeConfig
    """Rotary embedding parameters."""
    tie_word_embeddings: bool
    """The output layer reuses the embedding matrix."""
    qkv_bias: bool
    """Resolved from `arch.engine.qkv_bias` and the config."""
    o_bias: bool
    """Resolved from `arch.engine.o_bias` and the config."""
    sliding_window: int | None
    """The attention window if the config declares one (checked against max_model_len, never applied)."""
    moe: MoeConfig | None = None
    """The mixture of experts; None for a dense model."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k (resolved from `arch.qk_norm` and the config)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers the checkpoint stores after the decoder layers (skipped on load)."""
    mla: MlaConfig | None = None
    """Multi-latent attention in every layer; None: grouped-query attention."""

    def mlp_kind(self, layer: int) -> MlpKind:
        """The MLP block of one decoder layer."""
        return MlpKind.MOE if self.moe is not None and layer in self.moe.layers else MlpKind.DENSE

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Reads a transformers `PretrainedConfig` or a config.json dict."""
        hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        arch = find_arch(hf)
        hf = arch.with_absent(hf)
        _refuse_unsupported(hf)
        heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        mla = None
        if arch.multi_latent:
            mla, rope = read_mla(arch, hf)
            head_dim = mla.qk_rope_head_dim
        else:
            head_dim = int(hf.get("head_dim") or hf["hidden_size"] // heads)
            rope = read_rope(hf)
        if rope.rotary_dim(head_dim) % 2 or not rope.rotary_dim(head_dim):
            raise ValueError(
                f"partial_rotary_factor={rope.partial_rotary_factor:g} rotates {rope.rotary_dim(head_dim)} of the "
                f"{head_dim} dimensions of a head: the rotate_half layout needs an even, positive number"
            )
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_resolve_bias(arch.engine.qkv_bias, hf),
            o_bias=_resolve_bias(arch.engine.o_bias, hf),
            sliding_window=_sliding_window(hf),
            moe=MoeConfig.from_hf(arch, hf, num_layers) if arch.is_moe else None,
            qk_norm=arch.switched_on(arch.qk_norm, hf),
            mtp_layers=_mtp_layers(arch, hf),
            mla=mla,
        )


def _mtp_layers(arch: Architecture, hf: Mapping[str, Any]) -> int:
    """`num_nextn_predict_layers` of an architecture with MTP layers (0 for one without)."""
    if not arch.has_mtp:
        return 0
    try:
        return config_bridge.mtp_layer_count(hf)
    except ConfigError as err:
        raise ValueError(str(err)) from None


def _resolve_bias(rule: Bias, hf: Mapping[str, Any]) -> bool:
    if rule is Bias.FROM_CONFIG:
        return bool(hf.get("attention_bias") or False)
    if rule is Bias.FROM_QKV_BIAS:
        return bool(hf.get("qkv_bias", True))
    return rule is Bias.ALWAYS


def _sliding_window(hf: Mapping[str, Any]) -> int | None:
    # Qwen2/Qwen3 carry a `sliding_window` value even when `use_sliding_window` is false; only Mistral (which has
    # no such switch) applies it whenever it is set.
    if "use_sliding_window" in hf and not hf["use_sliding_window"]:
        return None
    window = hf.get("sliding_window")
    return int(window) if window else None


def _refuse_unsupported(hf: Mapping[str, Any]) -> None:
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r}: only 'silu' is implemented")
    if hf.get("mlp_bias"):
        raise NotImplementedError("mlp_bias=True is not implemented")
    if hf.get("use_sliding_window") and hf.get("sliding_window"):
        raise NotImplementedError("use_sliding_window=True is not implemented")


def read_rope(hf: Mapping[str, Any]) -> RopeConfig:
    """RoPE settings from transformers-5 `rope_parameters` or the older `rope_theta` + `rope_scaling` keys.

    A missing theta is an error: a default theta gives logits that are close but wrong.
    """
    params = dict(hf.get("rope_parameters") or {})
    if not params:
        params = dict(hf.get("rope_scaling") or {})
        if hf.get("rope_theta") is not None:
            params["rope_theta"] = hf["rope_theta"]
    if params.get("rope_theta") is None:
        raise ValueError("the config has no rope_theta (neither in rope_parameters nor at top level)")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in ("default", "linear", "llama3"):
        raise NotImplementedError(f"rope_type={rope_type!r}: only default, linear and llama3 are implemented")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    partial = float(partial if partial is not None else 1.0)
    if not 0 < partial <= 1:
        raise ValueError(f"partial_rotary_factor={partial:g} must be in (0, 1]")
    if rope_type == "default":
        return RopeConfig(theta=float(params["rope_theta"]), partial_rotary_factor=partial)
    if rope_type == "linear":
        return RopeConfig(
            theta=float(params["rope_theta"]),
            rope_type="linear",
            factor=float(params["factor"]),
            partial_rotary_factor=partial,
        )
    return RopeConfig(
        theta=float(params["rope_theta"]),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        partial_rotary_factor=partial,
    )


LAYER = "model.layers.{layer}"
EXPERT = "{expert}"
MC_LAYER = "decoder.layers.{layer}."

ENGINE_PARAMS: dict[str, str] = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "self_attention.linear_qkv.weight": "self_attn.qkv_proj.weight",
    "self_attention.linear_qkv.bias": "self_attn.qkv_proj.bias",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.weight": "mlp.gate_up_proj.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.router.weight": "mlp.gate.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "mlp.experts.local_experts.{expert}.linear_fc1.weight": "mlp.experts.w13",
    "mlp.experts.local_experts.{expert}.linear_fc2.weight": "mlp.experts.w2",
    "mlp.shared_experts.linear_fc1.weight": "mlp.shared_expert.gate_up_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mlp.shared_expert.down_proj.weight",
    "mlp.shared_experts.gate_weight": "mlp.shared_expert_gate.weight",
}
"""megatron-core tensor name (after `decoder.layers.{layer}.` for a layer's) -> the engine parameter it is, for
every architecture: the engine's modules are megatron-core's, under HF-style names."""


def engine_param(mcore: str) -> str:
    """The engine parameter of a mapping-table entry's megatron-core name (with its placeholders)."""
    if mcore.startswith(MC_LAYER):
        inner = mcore.removeprefix(MC_LAYER)
        if inner in ENGINE_PARAMS:
            return f"{LAYER}.{ENGINE_PARAMS[inner]}"
    elif mcore in ENGINE_PARAMS:
        return ENGINE_PARAMS[mcore]
    raise NotImplementedError(f"the engine has no parameter for megatron-core's {mcore!r}")


@dataclass(frozen=True)
class Direct:
    """An HF tensor that is one whole engine parameter (derived from the mapping table, as are the records
    below)."""

    name: str
    target: str | None = None
    """The engine parameter when its name differs from HF's (Mixtral's `block_sparse_moe` is the engine's `mlp`)."""
    parallel: Parallel = Parallel.REPLICATED
    """How the tensor-parallel engine splits it: `ROW` (input columns: o_proj, down_proj), `VOCAB` (rows of the
    embedding and output layer) or `REPLICATED` (whole on every rank: norms, routers, biases added after the
    all-reduce)."""


@dataclass(frozen=True)
class FusedQKV:
    """The engine's `qkv_proj` parameter: rows of q, then k, then v (HF's own order, unlike megatron-core); under
    tensor parallelism the rank's q heads, then its KV heads (column-parallel)."""

    target: str
    q: str
    k: str
    v: str


@dataclass(frozen=True)
class FusedGateUp:
    """The engine's `gate_up_proj` parameter: the gate rows, then the up rows, `width` rows each (full width);
    under tensor parallelism the rank's rows of gate, then of up (`Parallel.GATED_COLUMN`)."""

    target: str
    gate: str
    up: str
    width: int


@dataclass(frozen=True)
class ExpertSlice:
    """One expert's HF tensor (`{expert}` in `source`) as slice `[expert]` of a parameter stacked over experts."""

    target: str
    source: str
    parallel: Parallel = Parallel.REPLICATED
    """`ROW` for the down projection (expert tensor parallelism: each rank a slice of every expert's width)."""


@dataclass(frozen=True)
class ExpertGateUp:
    """One expert's gate and up tensors as slice `[expert]` of the stacked `w13`: gate rows, then up rows (under
    tensor parallelism the rank's rows of each, as `FusedGateUp`)."""

    target: str
    gate: str
    up: str
    width: int


Entry = Direct | FusedQKV | FusedGateUp | ExpertSlice | ExpertGateUp


def weight_table(cfg: ModelConfig, mlp: MlpKind) -> tuple[Entry, ...]:
    """Every HF tensor of a model whose layers have `mlp` blocks, and where it goes, derived from the
    architecture's mapping table.

    `{layer}` stands for the layer index, `{expert}` for the expert index; entries without `{layer}` are the
    model's own (embedding, final norm, output layer).
    """
    kind = LayerKind.MOE if mlp is MlpKind.MOE else LayerKind.DENSE
    q_lora = None if cfg.mla is None else cfg.mla.q_lora_rank
    features = {
        mt.Feature.QK_NORM: cfg.qk_norm,
        mt.Feature.QKV_BIAS: cfg.qkv_bias,
        mt.Feature.Q_LORA: cfg.mla is not None and q_lora is not None,
        mt.Feature.FULL_RANK_Q: cfg.mla is not None and q_lora is None,
    }
    table: list[Entry] = []
    for entry in cfg.arch.table:
        if entry.layers not in (LayerKind.ALL, kind) or (entry.untied_only and cfg.tie_word_embeddings):
            continue
        if entry.requires is not None and not features[entry.requires]:
            continue  # an optional part the config switches off (Qwen2-MoE's `qkv_bias: false`, GLM's q/k norms)
        table.append(_derived(cfg, entry))
    qkv = next((e for e in table if isinstance(e, FusedQKV)), None)
    biased = any(isinstance(e, FusedQKV) and e.target.endswith(".bias") for e in table)
    if qkv is not None and cfg.qkv_bias and not biased:
        table.append(FusedQKV(*(_bias_of(name) for name in (qkv.target, qkv.q, qkv.k, qkv.v))))
    if cfg.o_bias:
        o_proj = engine_param(f"{MC_LAYER}self_attention.linear_proj.weight")
        table.append(Direct(_bias_of(_hf_name(table, o_proj))))
    return tuple(table)


def _derived(cfg: ModelConfig, entry: mt.Entry) -> Entry:
    """The engine record of one mapping-table entry."""
    target = engine_param(entry.mcore)
    if isinstance(entry, mt.FusedQKV):
        return FusedQKV(target, q=entry.q, k=entry.k, v=entry.v)
    if isinstance(entry, mt.FusedGateUp):
        width = _width(cfg, entry.width)
        if EXPERT in entry.gate:
            return ExpertGateUp(target, gate=entry.gate, up=entry.up, width=width)
        return FusedGateUp(target, gate=entry.gate, up=entry.up, width=width)
    if EXPERT in entry.hf:
        return ExpertSlice(target, source=entry.hf, parallel=entry.parallel)
    return Direct(entry.hf, target=None if target == entry.hf else target, parallel=entry.parallel)


def _width(cfg: ModelConfig, size: Size) -> int:
    widths = {Size.FFN: cfg.intermediate_size}
    if cfg.moe is not None:
        widths[Size.EXPERT_FFN] = cfg.moe.expert_width
        if cfg.moe.shared_expert_width is not None:
            widths[Size.SHARED_FFN] = cfg.moe.shared_expert_width
    return widths[size]


def _bias_of(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".bias"


def _hf_name(table: list[Entry], param: str) -> str:
    """The HF name of the table record that fills `param`."""
    return next(e.name for e in table if isinstance(e, Direct) and (e.target or e.name) == param)


def ignored_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    """HF name prefixes accepted and dropped: the multi-token-prediction layers after the decoder layers."""
    return tuple(f"model.layers.{cfg.num_layers + k}." for k in range(cfg.mtp_layers))


def ignored_names(cfg: ModelConfig) -> tuple[str, ...]:
    """HF names accepted and dropped: a tied output layer, and rotary buffers that old checkpoints saved."""
    names = [f"{LAYER}.self_attn.rotary_emb.inv_freq"]
    if cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return tuple(names)


@dataclass(frozen=True)
class FusedPiece:
    """One per-expert HF tensor inside a fused transformers-5 tensor."""

    name: str
    """The per-expert HF name it stands for (a key of the weight table's expansion)."""
    expert: int | None
    """Index on the fused tensor's leading expert axis; None: the fused tensor is the piece (a renamed router)."""
    part: str
    """`gate` / `up`: the first / second half of the rows (after the expert index); `all`: every row."""


def fused_expert_pieces(cfg: ModelConfig) -> dict[str, tuple[FusedPiece, ...]]:
    """transformers-5 in-memory name -> the per-expert tensors it holds, for every MoE layer of `cfg`.

    Derived from the conversion's `fused_experts` rules of the architecture (per-expert template -> fused template,
    part); {} for a dense model or an architecture without such rules.
    """
    if cfg.moe is None:
        return {}
    rules = cfg.arch.fused_experts or {}
    pieces: dict[str, list[FusedPiece]] = {}
    for layer in sorted(cfg.moe.layers):
        for template, (fused_template, part) in rules.items():
            experts = range(cfg.moe.num_experts) if EXPERT in template else (None,)
            for expert in experts:
                fused = fill(fused_template, layer, expert)
                pieces.setdefault(fused, []).append(FusedPiece(fill(template, layer, expert), expert, part))
    return {name: tuple(found) for name, found in pieces.items()}
