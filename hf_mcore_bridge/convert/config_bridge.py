"""HF config <-> megatron-core configuration, both directions.

`ModelConfig` is the architecture-neutral description both sides are built from. From it come megatron-core's
`TransformerConfig` arguments, the `GPTModel` arguments and a Megatron-LM `args` namespace (so that
`--use-checkpoint-args` rebuilds the model), and back an HF `config.json` that `transformers.AutoConfig` accepts.

Anything megatron-core cannot represent is refused naming the field; nothing is approximated. In particular:
RoPE must be plain or Llama-3 scaled with megatron-core's hard-coded low/high frequency factors (1, 4) and
original length 8192, and a missing rope theta is an error rather than a default. Partial rotary embeddings
(`partial_rotary_factor`, GLM-4.5) are megatron-core's `rotary_percent`: both rotate the first
`int(head_dim * factor)` dimensions of each head in the `rotate_half` layout and pass the rest through.

Multi-latent attention (a config with `kv_lora_rank`, DeepSeek-V2/V3 style) is a property of the config, not of
an architecture name: its dimensions go to megatron-core's `MLATransformerConfig`, with plain RoPE or DeepSeek's
YaRN (`rope_type: yarn` with `factor`, `original_max_position_embeddings`, `beta_fast`/`beta_slow`, `mscale` and
`mscale_all_dim`, which megatron-core's `YarnRotaryEmbedding` computes as HF does). YaRN options HF has and
megatron-core lacks (`attention_factor`, `truncate: false`, `mscale_all_dim` without `mscale`) are refused.

Training-time behaviour that an HF config implies but that would change a trainer's objective is off here and
left to the trainer to switch on: the auxiliary load-balancing loss (`moe_aux_loss_coeff` 0) and the updates of
the router's expert bias (`moe_router_bias_update_rate` 0; GRPO: `policy.megatron_cfg.moe_router_bias_update_rate`).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.megatron_lm_args import loader_defaults
from hf_mcore_bridge.convert.layout import Layout, validate_layout
from hf_mcore_bridge.convert.transformer_impl import default_transformer_impl
from hf_mcore_bridge.errors import LayoutError
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import ConfigError, require
from hf_mcore_bridge.models.mapping_types import Dims, Feature
from hf_mcore_bridge.models.moe import MoeConfig
from hf_mcore_bridge.models.tensor_ops import padded_vocab_size

MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3 RoPE scaling constants megatron-core hard-codes."""

PARAMS_DTYPES = (dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16)
"""The dtypes a model's parameters are held in (`--dtype`'s choices, `dtypes.FLAGS`)."""


def params_dtype_name(dtype: Any) -> str | None:
    """The HF `torch_dtype` name of a parameter dtype (torch's or a `dtypes.DType`); None for any other value."""
    try:
        found = None if dtype is None else dtypes.of(dtype)
    except ValueError:
        return None
    return found.name if found in PARAMS_DTYPES else None


@dataclass(frozen=True)
class MlaConfig:
    """Multi-latent attention (DeepSeek-V2/V3): queries and keys/values through low-rank latents, RoPE on its own
    slice of every query/key head (megatron-core's `MLATransformerConfig`)."""

    q_lora_rank: int | None
    """Rank of the query's down-projection (HF `q_lora_rank`); None: one full-rank query projection (Moonlight)."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (HF `kv_lora_rank`)."""
    qk_nope_head_dim: int
    """Query/key dims per head without RoPE (HF `qk_nope_head_dim`; megatron-core's `qk_head_dim`)."""
    qk_rope_head_dim: int
    """Query/key dims per head with RoPE (HF `qk_rope_head_dim`; megatron-core's `qk_pos_emb_head_dim`)."""
    v_head_dim: int
    """Value dims per head."""
    rotate_half: bool = False
    """The HF weights order the rotary dims rotate-half style (HF `rope_interleave=false`); megatron-core's MLA
    pairs dims 2i, 2i + 1 as DeepSeek's weights do (`rope_interleave=true`), so such weights are permuted on the
    way (`mapping_types.RotaryRows`). megatron-core's checkpoint holds interleaved rows; its `args` record the HF
    order (`hf_rope_interleave`, as `hf_architecture` records the architecture) for export and refit."""


@dataclass(frozen=True)
class YarnConfig:
    """DeepSeek's YaRN RoPE scaling, as both HF and megatron-core's `YarnRotaryEmbedding` compute it."""

    factor: float
    """Context extension factor (HF `factor`; megatron-core's `rotary_scaling_factor`)."""
    original_max_position_embeddings: int
    """The pre-training context length the correction range is computed from."""
    beta_fast: float
    beta_slow: float
    mscale: float
    """Numerator of the rotary concentration `mscale(factor, mscale) / mscale(factor, mscale_all_dim)`."""
    mscale_all_dim: float
    """Denominator of that concentration; `mscale(factor, mscale_all_dim)^2` also multiplies the softmax scale."""


@dataclass(frozen=True)
class ModelConfig:
    """An architecture-neutral description of a dense Llama-family model."""

    architecture: str
    """The HF `architectures` entry."""
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    """The tokenizer's vocabulary (unpadded)."""
    max_position_embeddings: int
    norm_epsilon: float
    rope_theta: float
    rope_scaling_factor: float | None
    """Llama-3 RoPE scaling factor, or None for plain RoPE."""
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str | None = None
    """The dtype the HF checkpoint declares (`float32`, `bfloat16`, ...), if any."""
    moe: MoeConfig | None = None
    """The mixture-of-experts part, None for a dense model."""
    mla: MlaConfig | None = None
    """Multi-latent attention, None for grouped-query attention."""
    yarn: YarnConfig | None = None
    """YaRN RoPE scaling (with multi-latent attention only), None for none."""
    mtp_layers: int = 0
    """Multi-token-prediction layers after the decoder (HF `num_nextn_predict_layers` where the checkpoint holds
    their tensors; megatron-core's `mtp_num_layers`)."""
    rotary_percent: float = 1.0
    """The fraction of each head's dimensions that RoPE rotates (HF `partial_rotary_factor`, megatron-core's
    `rotary_percent`): the first `int(head_dim * rotary_percent)`; the rest pass through unrotated."""

    def has(self, feature: Feature) -> bool:
        """Whether the model has an optional part (a table entry that `requires` it is then present)."""
        if feature is Feature.Q_LORA:
            return self.mla is not None and self.mla.q_lora_rank is not None
        if feature is Feature.FULL_RANK_Q:
            return self.mla is not None and self.mla.q_lora_rank is None
        return {Feature.QK_NORM: self.qk_norm, Feature.QKV_BIAS: self.qkv_bias}[feature]

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and self.moe.moe_layers[layer]

    @property
    def homogeneous(self) -> bool:
        """All decoder layers of one kind: megatron-core then stacks them under one checkpoint key. A MoE model all
        of whose layers are dense is not (its `moe_layer_freq` is a list, which megatron-core never stacks)."""
        return self.moe is None or all(self.moe.moe_layers)

    def dims(self, padded_vocab: int) -> Dims:
        """The dimensions the mapping table's fused transforms need."""
        return Dims(
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            padded_vocab_size=padded_vocab,
            **(_mla_dims(self.mla) if self.mla else {}),
        )

    def validate(self, layout: Layout) -> None:
        """Refuse a layout megatron-core cannot build for this model."""
        validate_layout(
            layout,
            num_layers=self.num_layers,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            ffn_hidden_size=self.ffn_hidden_size,
            num_experts=self.moe.num_experts if self.moe else None,
            moe_ffn_hidden_size=self.moe.ffn_hidden_size if self.moe else None,
        )
        if self.mla is not None:
            _validate_mla_layout(self.mla, layout)


def _mla_dims(mla: MlaConfig) -> dict[str, Any]:
    return {
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "kv_lora_rank": mla.kv_lora_rank,
        "rotate_half_rotary": mla.rotate_half,
    }


def _validate_mla_layout(mla: MlaConfig, layout: Layout) -> None:
    """megatron-core's local layer spec splits MLA's down-projections over TP (column-parallel, then gathered)."""
    widths = {"kv_lora_rank + qk_rope_head_dim": mla.kv_lora_rank + mla.qk_rope_head_dim}
    if mla.q_lora_rank is not None:
        widths["q_lora_rank"] = mla.q_lora_rank
    for what, width in widths.items():
        if width % layout.tp:
            raise LayoutError(f"{what}={width} is not divisible by tp={layout.tp}")


def _positive_int(config: Mapping[str, Any], field: str) -> int:
    value = require(config, field)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field {field}={value!r} must be a positive integer")
    return value


def _rope(config: Mapping[str, Any], mla: bool = False) -> tuple[float, float | None, YarnConfig | None]:
    """(theta, llama3 scaling factor or None, YaRN or None) from either the transformers-5 or the older form.
    YaRN is taken with multi-latent attention (`mla`) only, Llama-3 scaling without it."""
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, Mapping) or ("rope_type" not in params and "rope_theta" not in params):
            raise ConfigError(f"config field rope_parameters={params!r} (per-layer-type RoPE) is not supported")
        theta = params.get("rope_theta", config.get("rope_theta"))
        scaling: Mapping[str, Any] | None = params
    else:
        theta = config.get("rope_theta")
        scaling = config.get("rope_scaling")
    if theta is None:
        raise ConfigError("config field 'rope_theta' is missing (no default is assumed: it changes the logits)")
    if not scaling:
        return float(theta), None, None
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None, None
    if rope_type == "yarn" and mla:
        return float(theta), None, _yarn(config, scaling)
    if rope_type == "yarn":
        raise ConfigError("config field rope_type='yarn' is converted with multi-latent attention only")
    if rope_type == "llama3" and mla:
        raise ConfigError("config field rope_type='llama3' cannot be represented in megatron-core's MLA")
    if rope_type != "llama3":
        raise ConfigError(f"config field rope_type={rope_type!r} cannot be represented in megatron-core")
    for field, expected in MCORE_LLAMA3_ROPE.items():
        value = scaling.get(field)
        if value is None or float(value) != expected:
            raise ConfigError(
                f"config field rope_scaling.{field}={value!r} cannot be represented in megatron-core "
                f"(it hard-codes {expected:g})"
            )
    return float(theta), float(require(scaling, "factor")), None


def _yarn(config: Mapping[str, Any], scaling: Mapping[str, Any]) -> YarnConfig:
    """HF's YaRN settings as megatron-core's: the same correction range (floor/ceil of the bounds), ramp and
    concentration. HF ignores `mscale` unless `mscale_all_dim` is set; megatron-core always uses both."""
    original = int(require(scaling, "original_max_position_embeddings"))
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else _positive_int(config, "max_position_embeddings") / original
    if scaling.get("attention_factor") is not None:
        raise ConfigError("config field rope_scaling.attention_factor cannot be represented in megatron-core")
    if scaling.get("truncate", True) is not True:
        raise ConfigError("config field rope_scaling.truncate=false cannot be represented in megatron-core")
    if float(scaling.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ConfigError("config field rope_scaling.partial_rotary_factor cannot be represented in megatron-core")
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if all_dim and not mscale:
        raise ConfigError(
            f"config field rope_scaling.mscale_all_dim={all_dim!r} without mscale cannot be represented in "
            "megatron-core (which divides the concentration by mscale(factor, mscale_all_dim))"
        )
    return YarnConfig(
        factor=factor,
        original_max_position_embeddings=original,
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
        mscale=float(mscale) if all_dim else 1.0,
        mscale_all_dim=float(all_dim or 0.0),
    )


def _mla(config: Mapping[str, Any], heads: int) -> MlaConfig | None:
    """Multi-latent attention where the config has `kv_lora_rank`; its key/value heads must be its query heads."""
    if config.get("kv_lora_rank") is None:
        return None
    groups = config.get("num_key_value_heads") or heads
    if groups != heads:
        raise ConfigError(
            f"config field num_key_value_heads={groups} cannot be represented with multi-latent attention "
            f"(megatron-core's MLA has one key/value head per query head, {heads})"
        )
    if config.get("attention_bias"):
        raise ConfigError("config field attention_bias=True cannot be represented in megatron-core's MLA")
    q_lora = config.get("q_lora_rank")
    return MlaConfig(
        q_lora_rank=_positive_int(config, "q_lora_rank") if q_lora is not None else None,
        kv_lora_rank=_positive_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_positive_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive_int(config, "qk_rope_head_dim"),
        v_head_dim=_positive_int(config, "v_head_dim"),
        rotate_half=config.get("rope_interleave", True) is False,
    )


def _rotary_percent(config: Mapping[str, Any], head_dim: int) -> float:
    """HF's `partial_rotary_factor` (in `rope_parameters` or at top level; 1 when absent), refused unless it
    rotates an even number of dimensions of each head."""
    params = config.get("rope_parameters")
    nested = params.get("partial_rotary_factor") if isinstance(params, Mapping) else None
    factor = nested if nested is not None else config.get("partial_rotary_factor", 1.0)
    factor = float(factor if factor is not None else 1.0)
    rotated = int(head_dim * factor)
    if not 0 < factor <= 1 or rotated % 2 or rotated == 0:
        raise ConfigError(
            f"config field partial_rotary_factor={factor:g} cannot be represented (it must rotate an even, "
            f"positive number of the {head_dim} dimensions of a head; it rotates {rotated})"
        )
    return factor


def mtp_layer_count(config: Mapping[str, Any]) -> int:
    """The multi-token-prediction layers an HF config declares (`num_nextn_predict_layers`; absent: 0)."""
    count = config.get("num_nextn_predict_layers") or 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ConfigError(f"config field num_nextn_predict_layers={count!r} must be a non-negative integer")
    return count


def _layer_types_are_full(config: Mapping[str, Any]) -> None:
    layer_types = config.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        raise ConfigError("config field layer_types has non-full attention layers; only full attention is supported")


def from_hf(config: Mapping[str, Any], arch: Architecture) -> ModelConfig:
    """Read an HF `config.json` (as a dict) of the given architecture, refusing what megatron-core cannot do."""
    config = arch.with_absent(config)
    if arch.check is not None:
        arch.check(config)
    _layer_types_are_full(config)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field hidden_act={act!r} cannot be represented (only 'silu')")
    heads = _positive_int(config, "num_attention_heads")
    groups = config.get("num_key_value_heads") or heads
    hidden = _positive_int(config, "hidden_size")
    head_dim = config.get("head_dim") or hidden // heads
    if heads % groups:
        raise ConfigError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={groups}")
    mla = _mla(config, heads)
    theta, factor, yarn = _rope(config, mla is not None)
    dtype = config.get("torch_dtype", config.get("dtype"))
    num_layers = _positive_int(config, "num_hidden_layers")
    moe = arch.moe_from_hf(config, num_layers) if arch.moe_from_hf else None
    mtp = mtp_layer_count(config)
    return ModelConfig(
        architecture=arch.hf_name,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=_positive_int(config, "intermediate_size"),
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        vocab_size=_positive_int(config, "vocab_size"),
        max_position_embeddings=_positive_int(config, "max_position_embeddings"),
        norm_epsilon=float(require(config, "rms_norm_eps")),
        rope_theta=theta,
        rope_scaling_factor=factor,
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=arch.switched_on(arch.qkv_bias, config),
        qk_norm=arch.switched_on(arch.qk_norm, config),
        torch_dtype=str(dtype) if dtype is not None else None,
        moe=moe,
        mla=mla,
        yarn=yarn,
        mtp_layers=mtp,
        rotary_percent=_rotary_percent(config, head_dim),
    )


def to_hf(model: ModelConfig, arch: Architecture, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An HF `config.json` dict for `model`. `extra` (token ids, ...) is merged in where it does not conflict."""
    rope_scaling = None
    if model.rope_scaling_factor is not None:
        rope_scaling = {"rope_type": "llama3", "factor": model.rope_scaling_factor, **MCORE_LLAMA3_ROPE}
    config: dict[str, Any] = {
        "architectures": [arch.hf_name],
        "model_type": arch.model_type,
        "hidden_act": "silu",
        "hidden_size": model.hidden_size,
        "intermediate_size": model.ffn_hidden_size,
        "num_hidden_layers": model.num_layers,
        "num_attention_heads": model.num_attention_heads,
        "num_key_value_heads": model.num_query_groups,
        "head_dim": model.head_dim,
        "vocab_size": model.vocab_size,
        "max_position_embeddings": model.max_position_embeddings,
        "rms_norm_eps": model.norm_epsilon,
        "rope_theta": model.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": model.tie_word_embeddings,
    }
    if model.mla is not None:
        config.update(_mla_to_hf(model))
    config.update(arch.hf_defaults or {})
    for switch, on in ((arch.qkv_bias, model.qkv_bias), (arch.qk_norm, model.qk_norm)):
        if isinstance(switch, str):
            config[switch] = on
    if model.rotary_percent != 1.0 or "partial_rotary_factor" in arch.hf_absent:
        config["partial_rotary_factor"] = model.rotary_percent
    if arch.has_mtp:
        config["num_nextn_predict_layers"] = model.mtp_layers
    if model.moe is not None and arch.moe_to_hf is not None:
        if model.moe.score_function != arch.score_function:
            raise ConfigError(
                f"{arch.hf_name} routes with {arch.score_function} scores; this model's router uses "
                f"{model.moe.score_function} (moe_router_score_function): pass --hf-config of the right architecture"
            )
        config.update(arch.moe_to_hf(model.moe))
    if model.torch_dtype is not None:
        config["torch_dtype"] = model.torch_dtype
    for key, value in (extra or {}).items():
        config.setdefault(key, value)
    return config


def _mla_to_hf(model: ModelConfig) -> dict[str, Any]:
    """The multi-latent attention fields of an HF config (DeepSeek-V3's names), with its RoPE."""
    assert model.mla is not None
    mla = model.mla
    fields: dict[str, Any] = {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,
        "rope_interleave": not mla.rotate_half,
    }
    if model.yarn is not None:
        yarn = model.yarn
        fields["rope_scaling"] = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": yarn.factor,
            "original_max_position_embeddings": yarn.original_max_position_embeddings,
            "beta_fast": yarn.beta_fast,
            "beta_slow": yarn.beta_slow,
            "mscale": yarn.mscale,
            "mscale_all_dim": yarn.mscale_all_dim,
        }
    return fields


def _mla_kwargs(model: ModelConfig) -> dict[str, Any]:
    """`MLATransformerConfig` fields (`megatron.model.transformer_config` picks that class when they are set)."""
    mla, yarn = model.mla, model.yarn
    if mla is None:
        return {}
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "qk_layernorm": True,  # the q and kv latents' RMSNorms (HF q_a_layernorm, kv_a_layernorm)
        "rope_type": "yarn" if yarn else "rope",
        "rotary_base": model.rope_theta,
        "rotary_percent": 1.0,
        "rotary_scaling_factor": yarn.factor if yarn else 1.0,
        "original_max_position_embeddings": yarn.original_max_position_embeddings if yarn else 4096,
        "beta_fast": yarn.beta_fast if yarn else 32.0,
        "beta_slow": yarn.beta_slow if yarn else 1.0,
        "mscale": yarn.mscale if yarn else 1.0,
        "mscale_all_dim": yarn.mscale_all_dim if yarn else 0.0,
        "apply_rope_fusion": False,
    }


def _moe_kwargs(moe: MoeConfig | None, layout: Layout) -> dict[str, Any]:
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_router_topk": moe.topk,
        "moe_layer_freq": 1 if all(moe.moe_layers) else [int(m) for m in moe.moe_layers],
        "moe_router_pre_softmax": moe.pre_softmax,
        # HF configs carry a pre-training load-balancing coefficient (`router_aux_loss_coef`); turned into an
        # always-on loss it would change the objective of every run that builds this config. A trainer that wants
        # it sets `moe_aux_loss_coeff` itself (GRPO: policy.megatron_cfg.transformer.moe_aux_loss_coeff).
        "moe_aux_loss_coeff": 0.0,
        "moe_shared_expert_intermediate_size": moe.shared_expert_size,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_router_score_function": moe.score_function,
        "moe_router_enable_expert_bias": moe.expert_bias,
        "moe_router_topk_scaling_factor": moe.topk_scaling_factor,
        "moe_router_num_groups": moe.num_groups,
        "moe_router_group_topk": moe.group_topk,
        "moe_router_dtype": "fp32" if moe.router_fp32 else None,
        # megatron-core moves the expert bias towards balanced loads after every optimizer step (default rate
        # 1e-3): a change to the model no loss asks for. A trainer that wants it sets the rate itself (GRPO:
        # policy.megatron_cfg.moe_router_bias_update_rate).
        "moe_router_bias_update_rate": 0.0,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "expert_tensor_parallel_size": layout.etp,
    }


def transformer_config_kwargs(model: ModelConfig, layout: Layout, dtype: Any) -> dict[str, Any]:
    """Keyword arguments for megatron-core's `TransformerConfig` (activation given as `torch.nn.functional.silu`;
    `transformer_impl` from `transformer_impl.default_transformer_impl`).

    MoE layers use the `allgather` token dispatcher, which also runs on CPU; override it for GPU training. The
    auxiliary load-balancing loss is off (`moe_aux_loss_coeff` 0, whatever the HF `router_aux_loss_coef`), and so
    are the expert-bias updates (`moe_router_bias_update_rate` 0). Multi-token-prediction layers are left out
    (`mtp_num_layers` unset): megatron-core's GPTModel then computes their loss on every forward and needs labels;
    `megatron.model.build_gpt_model(mtp=True)` builds them. `dtype`: torch's or a `dtypes.DType`.
    """
    import torch

    kind = dtypes.of(dtype)
    return (
        _moe_kwargs(model.moe, layout)
        | _mla_kwargs(model)
        | {
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "ffn_hidden_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_query_groups,
            "kv_channels": model.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": model.norm_epsilon,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu,
            "add_bias_linear": False,
            "add_qkv_bias": model.qkv_bias,
            "qk_layernorm": model.qk_norm or model.mla is not None,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp,
            "virtual_pipeline_model_parallel_size": layout.vpp,
            "context_parallel_size": layout.cp,
            "expert_model_parallel_size": layout.ep,
            "num_layers_in_first_pipeline_stage": layout.first_stage_layers,
            "num_layers_in_last_pipeline_stage": layout.last_stage_layers,
            "params_dtype": kind.torch,
            "pipeline_dtype": kind.torch,
            "bf16": kind == dtypes.BFLOAT16,
            "fp16": kind == dtypes.FLOAT16,
            "transformer_impl": default_transformer_impl(),
        }
    )


def gpt_model_kwargs(model: ModelConfig, padded_vocab: int) -> dict[str, Any]:
    """Keyword arguments for megatron-core's `GPTModel` besides the config and the layer spec."""
    return {
        "vocab_size": padded_vocab,
        "max_sequence_length": model.max_position_embeddings,
        "position_embedding_type": "rope",
        "rotary_percent": model.rotary_percent,
        "rotary_base": model.rope_theta,
        "rope_scaling": model.rope_scaling_factor is not None,
        "rope_scaling_factor": model.rope_scaling_factor or 8.0,
        "share_embeddings_and_output_weights": model.tie_word_embeddings,
    }


def padded_vocab(model: ModelConfig, layout: Layout, divisible_by: int = 128) -> int:
    """The vocabulary Megatron-LM would pad to for this layout."""
    return padded_vocab_size(model.vocab_size, divisible_by, layout.tp)


def megatron_args(
    model: ModelConfig,
    layout: Layout,
    dtype: Any,
    *,
    make_vocab_size_divisible_by: int = 128,
    spec: str = "te",
    ckpt_format: str = "torch_dist",
) -> argparse.Namespace:
    """A Megatron-LM `args` namespace describing the model and the target layout.

    It carries every attribute Megatron-LM's and Megatron-Bridge's checkpoint loaders read
    (`megatron_lm_args.LOADER_DEFAULTS`): Megatron-LM's default wherever the model sets nothing.
    """
    values = dict(
        num_layers=model.num_layers,
        encoder_num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        group_query_attention=model.num_query_groups != model.num_attention_heads,
        kv_channels=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        seq_length=model.max_position_embeddings,
        position_embedding_type="rope",
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        rotary_base=model.rope_theta,
        rotary_percent=model.rotary_percent,
        rotary_interleaved=False,
        use_rope_scaling=model.rope_scaling_factor is not None,
        rope_scaling_factor=model.rope_scaling_factor or 8.0,
        normalization="RMSNorm",
        norm_epsilon=model.norm_epsilon,
        layernorm_epsilon=model.norm_epsilon,
        apply_layernorm_1p=False,
        layernorm_zero_centered_gamma=False,
        swiglu=True,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        untie_embeddings_and_output_weights=not model.tie_word_embeddings,
        vocab_size=model.vocab_size,
        padded_vocab_size=padded_vocab(model, layout, make_vocab_size_divisible_by),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_per_virtual_pipeline_stage=(model.num_layers // (layout.pp * layout.vpp) if layout.vpp else None),
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        transformer_impl="transformer_engine" if spec == "te" else "local",
        params_dtype=dtype,  # as given: torch's, or a `dtypes.DType` (saved as torch's by `dcp_writer.saved`)
        bf16=dtypes.of(dtype) == dtypes.BFLOAT16,
        fp16=dtypes.of(dtype) == dtypes.FLOAT16,
        ckpt_format=ckpt_format,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tokenizer_type="HuggingFaceTokenizer",
        hf_architecture=model.architecture,
        mtp_num_layers=model.mtp_layers or None,
        **_moe_args(model.moe),
    )
    values.update(_mla_kwargs(model))
    if model.mla is not None:  # how the HF weights order their rotary rows (megatron-core's are interleaved)
        values["hf_rope_interleave"] = not model.mla.rotate_half
    return argparse.Namespace(**(loader_defaults() | values))


def _moe_args(moe: MoeConfig | None) -> dict[str, Any]:
    """The MoE part of Megatron-LM's args: the TransformerConfig fields under Megatron-LM's argument names."""
    if moe is None:
        return {"num_experts": None}
    args = _moe_kwargs(moe, Layout())
    args["num_experts"] = args.pop("num_moe_experts")
    del args["expert_tensor_parallel_size"]  # recorded with the layout
    del args["moe_router_bias_update_rate"]  # a training setting, not the model's
    # the args describe the model as its HF config does (export writes `router_aux_loss_coef` back from them)
    return args | {"moe_aux_loss_coeff": moe.aux_loss_coeff, "moe_router_load_balancing_type": "aux_loss"}


def _moe_from_args(args: argparse.Namespace, num_layers: int) -> MoeConfig | None:
    experts = getattr(args, "num_experts", None)
    if not experts:
        return None
    freq = getattr(args, "moe_layer_freq", 1)
    layers = tuple(bool(f) for f in freq) if isinstance(freq, list) else tuple(i % freq == 0 for i in range(num_layers))
    return MoeConfig(
        num_experts=experts,
        ffn_hidden_size=args.moe_ffn_hidden_size,
        topk=args.moe_router_topk,
        moe_layers=layers,
        pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)),
        aux_loss_coeff=float(getattr(args, "moe_aux_loss_coeff", 0.0)),
        shared_expert_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        score_function=getattr(args, "moe_router_score_function", None) or "softmax",
        expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        num_groups=getattr(args, "moe_router_num_groups", None),
        group_topk=getattr(args, "moe_router_group_topk", None),
        router_fp32=getattr(args, "moe_router_dtype", None) == "fp32",
    )


def _mla_from_args(args: argparse.Namespace) -> tuple[MlaConfig | None, YarnConfig | None]:
    """Multi-latent attention and its YaRN from Megatron-LM's argument names (megatron-core's field names)."""
    if not getattr(args, "multi_latent_attention", False):
        return None, None
    mla = MlaConfig(
        q_lora_rank=getattr(args, "q_lora_rank", None),
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_head_dim,
        qk_rope_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rotate_half=getattr(args, "hf_rope_interleave", True) is False,
    )
    if getattr(args, "rope_type", "yarn") != "yarn":
        return mla, None
    yarn = YarnConfig(
        factor=float(args.rotary_scaling_factor),
        original_max_position_embeddings=int(getattr(args, "original_max_position_embeddings", 4096)),
        beta_fast=float(getattr(args, "beta_fast", 32.0)),
        beta_slow=float(getattr(args, "beta_slow", 1.0)),
        mscale=float(getattr(args, "mscale", 1.0)),
        mscale_all_dim=float(getattr(args, "mscale_all_dim", 0.0)),
    )
    return mla, yarn


def from_megatron_args(args: argparse.Namespace) -> ModelConfig:
    """Rebuild a `ModelConfig` from a Megatron-LM `args` namespace (a checkpoint without stored HF assets)."""

    def get(name: str, default: Any = None) -> Any:
        value = getattr(args, name, default)
        if value is None and default is None:
            raise ConfigError(f"checkpoint args lack {name!r}; pass --hf-config")
        return value

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    if not getattr(args, "swiglu", False):
        raise ConfigError("checkpoint args describe a non-gated MLP (swiglu=False); only SwiGLU models are supported")
    if get("normalization", "LayerNorm") != "RMSNorm":
        raise ConfigError(f"checkpoint args normalization={args.normalization!r}; only RMSNorm is supported")
    architecture = getattr(args, "hf_architecture", None)
    mla, yarn = _mla_from_args(args)
    qk_norm = bool(getattr(args, "qk_layernorm", False)) and mla is None  # MLA's are its latents' norms
    qkv_bias = bool(getattr(args, "add_qkv_bias", False))
    scaling = getattr(args, "use_rope_scaling", False)
    moe = _moe_from_args(args, get("num_layers"))
    if architecture is None:  # written by Megatron-LM: the registered architecture with these features
        from hf_mcore_bridge.models.registry import with_features

        shared = moe is not None and bool(moe.shared_expert_size)
        features = {"moe": moe is not None, "shared_expert": shared, "qk_norm": qk_norm, "qkv_bias": qkv_bias}
        features["mla"] = mla is not None
        if moe is not None:
            features["score_function"] = moe.score_function
        architecture = with_features(**features).hf_name
    return ModelConfig(
        architecture=architecture,
        num_layers=get("num_layers"),
        hidden_size=hidden,
        ffn_hidden_size=get("ffn_hidden_size"),
        num_attention_heads=heads,
        num_query_groups=groups or heads,
        head_dim=getattr(args, "kv_channels", None) or hidden // heads,
        vocab_size=getattr(args, "vocab_size", None) or get("padded_vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        # `norm_epsilon` in the args written here, `layernorm_epsilon` (the TransformerConfig name) in Megatron-LM's
        norm_epsilon=float(getattr(args, "norm_epsilon", None) or get("layernorm_epsilon", 1e-5)),
        rope_theta=float(get("rotary_base")),
        rope_scaling_factor=float(args.rope_scaling_factor) if scaling else None,
        tie_word_embeddings=not get("untie_embeddings_and_output_weights", False),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        torch_dtype=params_dtype_name(getattr(args, "params_dtype", None)),
        moe=moe,
        mla=mla,
        yarn=yarn,
        mtp_layers=getattr(args, "mtp_num_layers", None) or 0,
        rotary_percent=float(getattr(args, "rotary_percent", None) or 1.0),
    )
