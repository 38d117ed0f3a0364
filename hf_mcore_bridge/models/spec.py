"""One description of a model, read once from its HF `config.json`: `ModelSpec`.

Conversion, export, verify, the engine, the DTensor path and the trainer all read a model through this frozen
description; none of them reads `config.json` fields itself. `ModelSpec.from_hf` reads a config as transformers
would run it (the architecture's `hf_absent` values where it lacks a field; either RoPE spelling; the
architecture's own mixture-of-experts reader, `Architecture.moe_from_hf`), and `ModelSpec.to_hf` writes one back
(export). Megatron-LM `args` are read into the same description by conversion (`convert.config_bridge`), which
owns that translation.

What it refuses: only what it cannot describe: an unknown architecture, a missing or malformed field, values
transformers itself would not run (a rotary width of an odd number of dimensions, multi-latent attention with
fewer key/value heads than query heads, an invalid router), RoPE per layer type other than full and sliding layers'
own, and fields an architecture names as unsupported (`Architecture.refused_when_set`). Everything it
can describe it holds, whether or not a given consumer runs it; each consumer refuses what it cannot compute, over
the spec: megatron-core's refusals are `convert.config_bridge.require_megatron_representable` (conversion refuses
Llama's `attention_bias` or a sliding window over every layer), the engine's are `engine.arch.require_runnable` (it
runs Llama's biases, which conversion refuses).

Simplifications: a sliding window, where switched on, is one window for every layer that `layer_types` marks
`sliding_attention` (or for all of them); RoPE is one set of parameters for every layer, or one for the full and one
for the sliding layers (Gemma 3's, `sliding_rope`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.models.architecture import Architecture, Switch
from hf_mcore_bridge.models.config_errors import ConfigError, require
from hf_mcore_bridge.models.mapping_types import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    Dims,
    Entry,
    Feature,
    LayerKind,
    Size,
)
from hf_mcore_bridge.models.moe import MoeSpec
from hf_mcore_bridge.models.registry import for_config, get_architecture, text_config

SLIDING_ATTENTION = "sliding_attention"
"""The `layer_types` entry of a layer attending through the sliding window."""


@dataclass(frozen=True)
class RopeSpec:
    """Rotary position embedding, normalised from either HF spelling (transformers 5's `rope_parameters`, or
    `rope_theta` with `rope_scaling`). Fields a RoPE type does not use keep their defaults."""

    theta: float
    """The base wavelength (`rope_theta`); a config without one is refused (a default changes the logits)."""
    rope_type: str = "default"
    """`default`, `linear`, `llama3`, `yarn`, or any other type the config names (held, refused by consumers)."""
    factor: float = 1.0
    """The scaling factor (`linear`, `llama3`, `yarn`, ...)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int | None = None
    """llama3, yarn: the context length the model was pre-trained with (None: not given)."""
    beta_fast: float = 32.0
    """yarn: frequencies of more than this many rotations over the original context are kept."""
    beta_slow: float = 1.0
    """yarn: frequencies of fewer than this many rotations are divided by `factor` (a linear ramp between)."""
    mscale: float | None = None
    """yarn: the numerator's `mscale` of the rotary concentration; None where transformers ignores it (without
    `mscale_all_dim`, or not given)."""
    mscale_all_dim: float = 0.0
    """yarn: the denominator's `mscale`; `mscale(factor, mscale_all_dim)^2` also multiplies the softmax scale of
    multi-latent attention (0: neither)."""
    attention_factor: float | None = None
    """yarn: an explicit rotary concentration (HF `attention_factor`), in place of the `mscale` formula."""
    truncate: bool = True
    """yarn: the correction range's bounds are rounded to whole dimensions (HF `truncate`, true by default)."""
    partial_rotary_factor: float = 1.0
    """The fraction of each head's rotary dimensions that rotate: the first `int(dims * factor)` (GLM-4.5: 0.5)."""

    def rotary_dim(self, head_dim: int) -> int:
        """The rotated dimensions of a head of `head_dim` rotary dimensions."""
        return int(head_dim * self.partial_rotary_factor)

    @property
    def attention_scaling(self) -> float:
        """The factor multiplying the cos and sin tables (transformers' `attention_scaling`): YaRN's concentration,
        `attention_factor` or mscale(factor, mscale) / mscale(factor, mscale_all_dim) (mscale(factor) without
        both); 1 for every other type."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor, 1.0)


def yarn_mscale(factor: float, mscale: float) -> float:
    """DeepSeek's YaRN magnitude scale: 0.1 * mscale * ln(factor) + 1 (1 for factor <= 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MlaSpec:
    """Multi-latent attention (DeepSeek-V2/V3, Kimi-K2, Moonlight): queries and keys/values through low-rank
    latents, RoPE on its own slice of every query/key head. Its key/value heads are its query heads."""

    q_lora_rank: int | None
    """Rank of the query's down-projection (`q_a_proj`, `q_a_layernorm`, `q_b_proj`); None: one full-rank
    `q_proj` (Moonlight)."""
    kv_lora_rank: int
    """Width of the compressed key/value latent (`kv_a_layernorm`), which an inference cache holds per token."""
    qk_nope_head_dim: int
    """Query/key dims per head without RoPE (megatron-core's `qk_head_dim`)."""
    qk_rope_head_dim: int
    """Query/key dims per head with RoPE; the key's are one head shared by all (megatron-core's
    `qk_pos_emb_head_dim`)."""
    v_head_dim: int
    """Value dims per head."""
    rope_interleave: bool = True
    """The HF weights order each head's rotary dims as interleaved pairs 2i, 2i + 1 (DeepSeek's own weights, HF
    `rope_interleave=true`, megatron-core's order); False: rotate-half pairs i, i + width/2, permuted on conversion
    (`mapping_types.RotaryRows`)."""

    @property
    def cache_width(self) -> int:
        """Values a cache holds per token and layer: the latent, then the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class LinearAttentionSpec:
    """Gated DeltaNet (Qwen3-Next, Qwen3.5) on the layers `layer_types` marks `linear_attention`: a causal depthwise
    convolution over q, k and v, the gated delta rule per value head (each key head serving
    `num_value_heads / num_key_heads` of them), a gated RMSNorm."""

    num_key_heads: int
    """Query/key heads (`linear_num_key_heads`)."""
    num_value_heads: int
    """Value heads (`linear_num_value_heads`), a multiple of the key heads."""
    key_head_dim: int
    """Width of a query/key head (`linear_key_head_dim`)."""
    value_head_dim: int
    """Width of a value head (`linear_value_head_dim`)."""
    conv_kernel: int
    """Width of the causal convolution (`linear_conv_kernel_dim`)."""

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only model of a registered architecture, as its HF config describes it."""

    architecture: str
    """The HF `architectures` entry of its registered architecture (`arch`)."""
    num_layers: int
    """Decoder layers (`num_hidden_layers`), multi-token-prediction layers not counted."""
    hidden_size: int
    """Width of the residual stream."""
    ffn_hidden_size: int
    """Width of the dense gated MLP (`intermediate_size`; Mixtral: its experts' width)."""
    num_attention_heads: int
    """Query heads."""
    num_query_groups: int
    """Key/value heads (`num_key_value_heads`; grouped-query attention when fewer than the query heads)."""
    head_dim: int
    """Width of one attention head (`head_dim`, else hidden_size // num_attention_heads)."""
    vocab_size: int
    """The tokenizer's vocabulary: rows of the embedding and of the output layer (unpadded)."""
    max_position_embeddings: int
    """The longest sequence the config declares."""
    norm_epsilon: float
    """Epsilon of every RMSNorm (`rms_norm_eps`; a multi-latent model's latent norms: `latent_norm_eps`)."""
    rope: RopeSpec
    """Rotary position embedding."""
    tie_word_embeddings: bool
    """The output layer reuses the embedding matrix."""
    qkv_bias: bool
    """Biases on the q, k and v projections (`Architecture.qkv_bias`: Qwen2's always, Llama's `attention_bias`)."""
    qk_norm: bool
    """RMSNorm on each head of q and k (`Architecture.qk_norm`: Qwen3's always, GLM-4.5's `use_qk_norm`)."""
    o_bias: bool = False
    """A bias on the attention's output projection (`Architecture.o_bias`: Llama's `attention_bias`)."""
    mlp_bias: bool = False
    """Biases on the MLP projections (HF `mlp_bias`)."""
    hidden_act: str = "silu"
    """The gated MLP's activation (HF `hidden_act`)."""
    sliding_window: int | None = None
    """The attention window, where the config switches one on (`Architecture.sliding_window_switch`, else a set
    `sliding_window`); None: every layer attends to every earlier position."""
    attention_sinks: bool = False
    """A learnable logit per query head in every softmax denominator (`Architecture.attention_sinks`: GPT-OSS's
    `self_attn.sinks`)."""
    layer_types: tuple[str, ...] = ()
    """Per decoder layer, its attention (`full_attention`, `sliding_attention`, ... as transformers-5 configs list
    them); all `full_attention` where the config lists none."""
    torch_dtype: str | None = None
    """The dtype the HF checkpoint declares (`float32`, `bfloat16`, ...), if any."""
    moe: MoeSpec | None = None
    """The mixture of experts; None for a dense model."""
    mla: MlaSpec | None = None
    """Multi-latent attention in every layer; None: grouped-query attention."""
    mtp_layers: int = 0
    """Multi-token-prediction layers after the decoder (HF `num_nextn_predict_layers`, where the architecture has
    them: DeepSeek-V3, GLM-4.5)."""
    norm_offset: bool = False
    """Every RMSNorm scales by `1 + weight` (`Architecture.norm_offset`: Gemma's; the stored weight is the offset)."""
    post_norms: bool = False
    """RMSNorms on the attention's and the MLP's outputs before each residual add (`Architecture.post_norms`)."""
    embedding_scale: bool = False
    """The embeddings are multiplied by sqrt(hidden_size) rounded to the model's dtype (`Architecture.embedding_scale`).
    """
    sliding_rope: RopeSpec | None = None
    """RoPE of the `sliding_attention` layers, where they have their own (Gemma 3's `rope_local_base_freq`); None:
    `rope` on every layer."""
    query_pre_attn_scalar: float | None = None
    """The attention's softmax scale is this^-0.5 (Gemma 3's `query_pre_attn_scalar`); None: head_dim^-0.5."""
    linear_attention: LinearAttentionSpec | None = None
    """Gated DeltaNet on the `linear_attention` layers (`Architecture.linear_attention`); None: no such layers."""
    attention_output_gate: bool = False
    """The full-attention layers gate their output per head (`Architecture.attention_output_gate`)."""

    @property
    def arch(self) -> Architecture:
        """The registered architecture (its file in `mappings/`)."""
        return get_architecture(self.architecture)

    def has(self, feature: Feature) -> bool:
        """Whether the model has an optional part (a table entry that `requires` it is then present)."""
        if feature is Feature.Q_LORA:
            return self.mla is not None and self.mla.q_lora_rank is not None
        if feature is Feature.FULL_RANK_Q:
            return self.mla is not None and self.mla.q_lora_rank is None
        return {Feature.QK_NORM: self.qk_norm, Feature.QKV_BIAS: self.qkv_bias, Feature.O_BIAS: self.o_bias}[feature]

    def table(self) -> tuple[Entry, ...]:
        """The architecture's table entries this model has: without a tied output layer and without the optional
        parts its config switches off."""
        return tuple(
            entry
            for entry in self.arch.table
            if not (entry.untied_only and self.tie_word_embeddings)
            and (entry.requires is None or self.has(entry.requires))
        )

    def is_moe_layer(self, layer: int) -> bool:
        """Whether decoder layer `layer` has routed experts."""
        return self.moe is not None and self.moe.moe_layers[layer]

    def layer_kind(self, layer: int) -> LayerKind:
        """The MLP of decoder layer `layer`: `LayerKind.MOE` or `LayerKind.DENSE`."""
        return LayerKind.MOE if self.is_moe_layer(layer) else LayerKind.DENSE

    @property
    def homogeneous(self) -> bool:
        """All decoder layers of one kind: megatron-core then stacks them under one checkpoint key. A MoE model all
        of whose layers are dense is not (its `moe_layer_freq` is a list, which megatron-core never stacks), nor is
        a hybrid of Gated DeltaNet and full attention."""
        if self.linear_attention is not None:  # a per-layer `linear_attention_freq`, never stacked either
            return False
        return self.moe is None or all(self.moe.moe_layers)

    @property
    def rotary_dim(self) -> int:
        """The rotated dimensions of a query/key head (of its `qk_rope_head_dim` under multi-latent attention)."""
        return self.rope.rotary_dim(self.mla.qk_rope_head_dim if self.mla else self.head_dim)

    @property
    def softmax_scale(self) -> float:
        """The attention's score scale: query_pre_attn_scalar^-0.5 where set, else head_dim^-0.5; under multi-latent
        attention qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (transformers' DeepSeek-V3
        attention)."""
        if self.query_pre_attn_scalar is not None:
            return self.query_pre_attn_scalar**-0.5
        if self.mla is None:
            return self.head_dim**-0.5
        scale = (self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim) ** -0.5
        if self.rope.rope_type == "yarn" and self.rope.mscale_all_dim:
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    @property
    def latent_norm_eps(self) -> float:
        """Epsilon of the multi-latent attention's latent norms: the architecture's own (`latent_norm_eps`, HF's
        DeepSeek-V3 hard-codes 1e-6), else `norm_epsilon`."""
        eps = self.arch.latent_norm_eps
        return self.norm_epsilon if eps is None else eps

    def sizes(self) -> dict[Size, int | None]:
        """Every model dimension the tables' shapes are written in (None: a dimension this model lacks)."""
        moe, mla, heads = self.moe, self.mla, self.num_attention_heads
        mla_sizes: dict[Size, int | None] = {}
        if mla is not None:
            mla_sizes = {
                Size.MLA_Q: heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim),
                Size.Q_LORA: mla.q_lora_rank,
                Size.KV_LORA: mla.kv_lora_rank,
                Size.KV_DOWN: mla.kv_lora_rank + mla.qk_rope_head_dim,
                Size.KV_UP: heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                Size.MLA_V: heads * mla.v_head_dim,
            }
        return (
            mla_sizes
            | {
                Size.HIDDEN: self.hidden_size,
                Size.Q: heads * self.head_dim,
                Size.KV: self.num_query_groups * self.head_dim,
                Size.HEAD_DIM: self.head_dim,
                Size.HEADS: heads,
                Size.FFN: self.ffn_hidden_size,
                Size.EXPERT_FFN: moe.ffn_hidden_size if moe else None,
                Size.SHARED_FFN: moe.shared_expert_size if moe else None,
                Size.VOCAB: self.vocab_size,
                Size.EXPERTS: moe.num_experts if moe else None,
                Size.ONE: 1,
                Size.TWO_HIDDEN: 2 * self.hidden_size,
                Size.Q_GATED: 2 * heads * self.head_dim if self.attention_output_gate else None,
            }
            | self._linear_sizes()
        )

    def _linear_sizes(self) -> dict[Size, int | None]:
        linear = self.linear_attention
        if linear is None:
            return {}
        return {
            Size.LINEAR_QKV: 2 * linear.key_dim + linear.value_dim,
            Size.LINEAR_QKVZ: 2 * linear.key_dim + 2 * linear.value_dim,
            Size.LINEAR_V: linear.value_dim,
            Size.LINEAR_HEADS: linear.num_value_heads,
            Size.LINEAR_V_HEAD: linear.value_head_dim,
            Size.LINEAR_BA: 2 * linear.num_value_heads,
            Size.CONV_KERNEL: linear.conv_kernel,
        }

    def dims(self, padded_vocab: int) -> Dims:
        """The dimensions the mapping table's fused transforms need, with the vocabulary padded to
        `padded_vocab` rows."""
        mla = self.mla
        latent: dict[str, Any] = {}
        if mla is not None:
            latent = {
                "qk_nope_head_dim": mla.qk_nope_head_dim,
                "qk_rope_head_dim": mla.qk_rope_head_dim,
                "kv_lora_rank": mla.kv_lora_rank,
                "rotate_half_rotary": not mla.rope_interleave,
            }
        linear = self.linear_attention
        if linear is not None:
            latent |= {
                "linear_key_heads": linear.num_key_heads,
                "linear_value_heads": linear.num_value_heads,
                "linear_key_head_dim": linear.key_head_dim,
                "linear_value_head_dim": linear.value_head_dim,
            }
        return Dims(
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            head_dim=self.head_dim,
            vocab_size=self.vocab_size,
            padded_vocab_size=padded_vocab,
            **latent,
        )

    @classmethod
    def from_hf(cls, config: Any) -> ModelSpec:
        """Read an HF config (a `config.json` dict or a transformers `PretrainedConfig`) of a registered
        architecture, or of a vision-language wrapper of one (its language model: `registry.text_config`). Raises
        `UnsupportedArchitectureError` or `ConfigError` (see the module docstring)."""
        raw = dict(text_config(config.to_dict() if hasattr(config, "to_dict") else dict(config)))
        arch = for_config(raw)
        hf = arch.with_absent(raw)
        _require_fields(arch, hf)
        heads = _positive_int(hf, "num_attention_heads")
        groups = hf.get("num_key_value_heads") or heads
        if heads % groups:
            raise ConfigError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={groups}")
        hidden = _positive_int(hf, "hidden_size")
        head_dim = hf.get("head_dim") or hidden // heads
        num_layers = _positive_int(hf, "num_hidden_layers")
        mla = _mla(hf, heads)
        rope = _rope(hf)
        _check_rotation(rope, mla.qk_rope_head_dim if mla else head_dim)
        other = LINEAR_ATTENTION if arch.linear_attention else SLIDING_ATTENTION
        layer_types = _layer_types(hf, num_layers, arch.full_attention_period, other)
        scalar = hf.get(arch.softmax_scale_field) if arch.softmax_scale_field else None
        dtype = hf.get("torch_dtype", hf.get("dtype"))
        return cls(
            architecture=arch.hf_name,
            num_layers=num_layers,
            hidden_size=hidden,
            ffn_hidden_size=_positive_int(hf, "intermediate_size"),
            num_attention_heads=heads,
            num_query_groups=groups,
            head_dim=head_dim,
            vocab_size=_positive_int(hf, "vocab_size"),
            max_position_embeddings=_positive_int(hf, "max_position_embeddings"),
            norm_epsilon=float(require(hf, "rms_norm_eps")),
            rope=rope,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=arch.switched_on(arch.qkv_bias, hf),
            qk_norm=arch.switched_on(arch.qk_norm, hf),
            o_bias=arch.switched_on(arch.o_bias, hf),
            mlp_bias=bool(hf.get("mlp_bias") or False),
            hidden_act=str(hf.get(arch.hidden_act_field, "silu")),
            sliding_window=_sliding_window(arch, hf),
            attention_sinks=arch.attention_sinks,
            layer_types=layer_types,
            torch_dtype=str(dtype) if dtype is not None else None,
            moe=arch.moe_from_hf(hf, num_layers) if arch.moe_from_hf else None,
            mla=mla,
            mtp_layers=mtp_layer_count(hf) if arch.has_mtp else 0,
            norm_offset=arch.norm_offset,
            post_norms=arch.post_norms,
            embedding_scale=arch.embedding_scale,
            sliding_rope=_sliding_rope(arch, hf, rope) if SLIDING_ATTENTION in layer_types else None,
            query_pre_attn_scalar=float(scalar) if scalar is not None else None,
            linear_attention=_linear_attention(hf) if arch.linear_attention else None,
            attention_output_gate=arch.attention_output_gate,
        )

    def to_hf(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """An HF `config.json` dict of this model that transformers' `AutoConfig` accepts. `extra` (token ids, ...)
        is merged in where it does not conflict."""
        arch = self.arch
        config: dict[str, Any] = {
            "architectures": [arch.hf_name],
            "model_type": arch.model_type,
            arch.hidden_act_field: self.hidden_act,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.ffn_hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_query_groups,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.norm_epsilon,
            "rope_theta": self.rope.theta,
            "rope_scaling": _rope_scaling_to_hf(self.rope),
            "tie_word_embeddings": self.tie_word_embeddings,
        }
        if self.mla is not None:
            config.update(_mla_to_hf(self.mla))
        config.update(arch.hf_defaults or {})
        config.update(self._switches_to_hf())
        if self.rope.partial_rotary_factor != 1.0 or "partial_rotary_factor" in arch.hf_absent:
            config["partial_rotary_factor"] = self.rope.partial_rotary_factor
        if any(kind != FULL_ATTENTION for kind in self.layer_types):
            config["layer_types"] = list(self.layer_types)
        if arch.has_mtp:
            config["num_nextn_predict_layers"] = self.mtp_layers
        config.update(self._gemma_fields_to_hf())
        if self.linear_attention is not None:
            config.update(_linear_attention_to_hf(self.linear_attention))
        if self.moe is not None and arch.moe_to_hf is not None:
            if self.moe.score_function != arch.score_function:
                raise ConfigError(
                    f"{arch.hf_name} routes with {arch.score_function} scores; this model's router uses "
                    f"{self.moe.score_function} (moe_router_score_function): pass --hf-config of the right "
                    "architecture"
                )
            config.update(arch.moe_to_hf(self.moe))
        if self.torch_dtype is not None:
            config["torch_dtype"] = self.torch_dtype
        for key, value in (extra or {}).items():
            config.setdefault(key, value)
        return config

    def _gemma_fields_to_hf(self) -> dict[str, Any]:
        """The sliding layers' RoPE base and the softmax scale's field, where the architecture names them."""
        arch, fields = self.arch, {}
        if arch.sliding_rope_theta is not None:
            fields[arch.sliding_rope_theta] = (self.sliding_rope or self.rope).theta
        if arch.softmax_scale_field is not None and self.query_pre_attn_scalar is not None:
            scalar = self.query_pre_attn_scalar
            fields[arch.softmax_scale_field] = int(scalar) if scalar == int(scalar) else scalar
        return fields

    def _switches_to_hf(self) -> dict[str, Any]:
        """The config fields that switch this model's optional parts on or off."""
        arch = self.arch
        fields: dict[str, Any] = {}
        for switch, on in ((arch.qkv_bias, self.qkv_bias), (arch.o_bias, self.o_bias), (arch.qk_norm, self.qk_norm)):
            if isinstance(switch, str):
                fields[switch] = fields.get(switch, False) or on
        if self.mlp_bias:
            fields["mlp_bias"] = True
        if self.sliding_window is not None:
            fields["sliding_window"] = self.sliding_window
            if arch.sliding_window_switch is not None:
                fields[arch.sliding_window_switch] = True
        return fields


def switch_name(switch: Switch, default: str) -> str:
    """The HF config field that switches an optional part, for messages (`default` for a fixed part)."""
    return switch if isinstance(switch, str) else default


def _positive_int(config: Mapping[str, Any], name: str) -> int:
    value = require(config, name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config field {name}={value!r} must be a positive integer")
    return value


def mtp_layer_count(config: Mapping[str, Any]) -> int:
    """The multi-token-prediction layers an HF config declares (`num_nextn_predict_layers`; absent: 0)."""
    count = config.get("num_nextn_predict_layers") or 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ConfigError(f"config field num_nextn_predict_layers={count!r} must be a non-negative integer")
    return count


def _require_fields(arch: Architecture, config: Mapping[str, Any]) -> None:
    """The architecture's refused fields unset."""
    for name in arch.refused_when_set:
        if config.get(name):
            raise ConfigError(f"config field {name}={config[name]!r} is not supported")


def _rope_fields(config: Mapping[str, Any], layer_type: str = FULL_ATTENTION) -> tuple[Any, Mapping[str, Any]]:
    """(theta, the RoPE parameters) from transformers 5's `rope_parameters` (per layer type where it is keyed by
    `layer_types` entries: the `layer_type` ones) or the older `rope_theta` + `rope_scaling`."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and layer_type in params and isinstance(params[layer_type], Mapping):
        params = params[layer_type]
    if params is not None:
        if not isinstance(params, Mapping) or ("rope_type" not in params and "rope_theta" not in params):
            raise ConfigError(f"config field rope_parameters={params!r} (per-layer-type RoPE) is not supported")
        return params.get("rope_theta", config.get("rope_theta")), params
    return config.get("rope_theta"), config.get("rope_scaling") or {}


def _sliding_rope(arch: Architecture, config: Mapping[str, Any], rope: RopeSpec) -> RopeSpec | None:
    """The sliding layers' own RoPE: transformers 5's `rope_parameters.sliding_attention`, else plain RoPE at the
    architecture's local base (`Architecture.sliding_rope_theta`); None where they have none (or it is `rope`)."""
    params = config.get("rope_parameters")
    if isinstance(params, Mapping) and isinstance(params.get(SLIDING_ATTENTION), Mapping):
        local = _rope(config, SLIDING_ATTENTION)
    elif arch.sliding_rope_theta is not None and config.get(arch.sliding_rope_theta) is not None:
        partial = rope.partial_rotary_factor
        local = RopeSpec(theta=float(config[arch.sliding_rope_theta]), partial_rotary_factor=partial)
    else:
        return None
    return None if local == rope else local


def _rope(config: Mapping[str, Any], layer_type: str = FULL_ATTENTION) -> RopeSpec:
    """RoPE from either spelling; the fields of its type (llama3's and yarn's required ones refused when missing)."""
    theta, params = _rope_fields(config, layer_type)
    if theta is None:
        raise ConfigError("config field 'rope_theta' is missing (no default is assumed: it changes the logits)")
    rope_type = str(params.get("rope_type", params.get("type")) or "default")
    partial = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    common: dict[str, Any] = {
        "theta": float(theta),
        "rope_type": rope_type,
        "partial_rotary_factor": float(partial if partial is not None else 1.0),
    }
    if rope_type == "default":
        return RopeSpec(**common)
    if rope_type == "llama3":
        original = int(require_rope(params, "original_max_position_embeddings"))
        return RopeSpec(
            **common,
            factor=float(require_rope(params, "factor")),
            low_freq_factor=float(require_rope(params, "low_freq_factor")),
            high_freq_factor=float(require_rope(params, "high_freq_factor")),
            original_max_position_embeddings=original,
        )
    if rope_type == "yarn":
        return _yarn(config, params, common)
    factor = params.get("factor")
    return RopeSpec(**common, factor=float(factor) if factor is not None else 1.0)


def require_rope(params: Mapping[str, Any], name: str) -> Any:
    """A RoPE parameter its type needs, or an error naming it."""
    if params.get(name) is None:
        raise ConfigError(f"config field rope_scaling.{name} is missing")
    return params[name]


def _yarn(config: Mapping[str, Any], params: Mapping[str, Any], common: dict[str, Any]) -> RopeSpec:
    """YaRN as transformers computes it. `mscale` counts only beside `mscale_all_dim` (transformers ignores it
    otherwise), so it is held as None there; a missing `factor` is max_position_embeddings / the original length
    (which is then required; consumers that compute YaRN require it anyway)."""
    original = params.get("original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = _positive_int(config, "max_position_embeddings") / int(
            require_rope(params, "original_max_position_embeddings")
        )
    mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
    explicit = params.get("attention_factor")
    return RopeSpec(
        **common,
        factor=float(factor),
        original_max_position_embeddings=int(original) if original is not None else None,
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=float(mscale) if mscale and all_dim else None,
        mscale_all_dim=float(all_dim or 0.0),
        attention_factor=float(explicit) if explicit is not None else None,
        truncate=params.get("truncate", True) is not False,
    )


def _check_rotation(rope: RopeSpec, head_dim: int) -> None:
    """A partial rotary embedding must rotate an even, positive number of a head's rotary dimensions (the
    rotate-half layout pairs them)."""
    factor, rotated = rope.partial_rotary_factor, rope.rotary_dim(head_dim)
    if not 0 < factor <= 1 or rotated % 2 or rotated == 0:
        raise ConfigError(
            f"config field partial_rotary_factor={factor:g} is not supported: it rotates {rotated} of the {head_dim} "
            "dimensions of a head, and the rotate_half layout needs an even, positive number"
        )


def _mla(config: Mapping[str, Any], heads: int) -> MlaSpec | None:
    """Multi-latent attention where the config has `kv_lora_rank`; its key/value heads must be its query heads
    (transformers' attention repeats keys over `num_key_value_heads` groups of the query heads' keys)."""
    if config.get("kv_lora_rank") is None:
        return None
    groups = config.get("num_key_value_heads") or heads
    if groups != heads:
        raise ConfigError(
            f"config field num_key_value_heads={groups} is not supported with multi-latent attention: its key/value "
            f"heads are its {heads} query heads"
        )
    q_lora = config.get("q_lora_rank")
    return MlaSpec(
        q_lora_rank=_positive_int(config, "q_lora_rank") if q_lora is not None else None,
        kv_lora_rank=_positive_int(config, "kv_lora_rank"),
        qk_nope_head_dim=_positive_int(config, "qk_nope_head_dim"),
        qk_rope_head_dim=_positive_int(config, "qk_rope_head_dim"),
        v_head_dim=_positive_int(config, "v_head_dim"),
        rope_interleave=config.get("rope_interleave", True) is not False,
    )


def _sliding_window(arch: Architecture, config: Mapping[str, Any]) -> int | None:
    switch = arch.sliding_window_switch
    if switch is not None and not config.get(switch):
        return None
    window = config.get("sliding_window")
    return int(window) if window else None


def _layer_types(
    config: Mapping[str, Any], num_layers: int, period_field: str | None = None, other: str = SLIDING_ATTENTION
) -> tuple[str, ...]:
    """`layer_types` as listed; where absent, derived as transformers does from the architecture's full-attention
    period (`Architecture.full_attention_period`: the layers it does not mark full are `other`), else every layer
    full."""
    listed = config.get("layer_types")
    if not listed and period_field is not None:
        period = _positive_int(config, period_field)
        return tuple(FULL_ATTENTION if (i + 1) % period == 0 else other for i in range(num_layers))
    if not listed:
        return (FULL_ATTENTION,) * num_layers
    if len(listed) != num_layers:
        raise ConfigError(f"config field layer_types lists {len(listed)} layers, not num_hidden_layers={num_layers}")
    return tuple(str(kind) for kind in listed)


LINEAR_FIELDS = {
    "num_key_heads": "linear_num_key_heads",
    "num_value_heads": "linear_num_value_heads",
    "key_head_dim": "linear_key_head_dim",
    "value_head_dim": "linear_value_head_dim",
    "conv_kernel": "linear_conv_kernel_dim",
}
"""`LinearAttentionSpec`'s fields and the HF config fields they come from."""


def _linear_attention(config: Mapping[str, Any]) -> LinearAttentionSpec:
    """Gated DeltaNet's dimensions; value heads a multiple of the key heads (transformers repeats each key head over
    consecutive value heads)."""
    linear = LinearAttentionSpec(**{name: _positive_int(config, hf) for name, hf in LINEAR_FIELDS.items()})
    if linear.num_value_heads % linear.num_key_heads:
        raise ConfigError(
            f"linear_num_value_heads={linear.num_value_heads} is not a multiple of "
            f"linear_num_key_heads={linear.num_key_heads}"
        )
    return linear


def _linear_attention_to_hf(linear: LinearAttentionSpec) -> dict[str, Any]:
    return {hf: getattr(linear, name) for name, hf in LINEAR_FIELDS.items()}


def _rope_scaling_to_hf(rope: RopeSpec) -> dict[str, Any] | None:
    """The `rope_scaling` of an HF config (None for plain RoPE)."""
    if rope.rope_type == "default":
        return None
    if rope.rope_type == "llama3":
        return {
            "rope_type": "llama3",
            "factor": rope.factor,
            "low_freq_factor": rope.low_freq_factor,
            "high_freq_factor": rope.high_freq_factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
        }
    if rope.rope_type == "yarn":
        scaling = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": rope.factor,
            "original_max_position_embeddings": rope.original_max_position_embeddings,
            "beta_fast": rope.beta_fast,
            "beta_slow": rope.beta_slow,
            "mscale": rope.mscale if rope.mscale is not None else 1.0,
            "mscale_all_dim": rope.mscale_all_dim,
        }
        if rope.attention_factor is not None:
            scaling["attention_factor"] = rope.attention_factor
        if not rope.truncate:
            scaling["truncate"] = False
        return scaling
    return {"rope_type": rope.rope_type, "factor": rope.factor}


def _mla_to_hf(mla: MlaSpec) -> dict[str, Any]:
    """The multi-latent attention fields of an HF config (DeepSeek-V3's names)."""
    return {
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_nope_head_dim": mla.qk_nope_head_dim,
        "qk_rope_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "head_dim": mla.qk_rope_head_dim,
        "rope_interleave": mla.rope_interleave,
    }
