"""Per-architecture data for the engine's one shared decoder, and the HF weight-name table it loads from.

Every supported architecture is the same pre-norm decoder (RMSNorm, rotary attention with grouped KV heads,
SiLU-gated MLP); what differs is data on an `ArchSpec`: which projections carry a bias and whether q and k get a
per-head RMSNorm. `ModelConfig.from_hf` reads an HF config (a `PretrainedConfig` or its dict) into the frozen
`ModelConfig` the decoder is built from, refusing values the decoder would silently get wrong.

`weight_table` lists, once, every HF tensor name (with a `{layer}` placeholder) and the engine parameter it fills:
`Direct` entries copy a whole tensor, `FusedQKV` / `FusedGateUp` entries name the HF sources that are stacked, in
row order, into the engine's fused `qkv_proj` / `gate_up_proj` parameters.

Simplifications and how to extend:
- Only dense MLPs (`MlpKind.DENSE`). A mixture-of-experts architecture (Mixtral, Qwen3-MoE) is added as one
  `ArchSpec` with `mlp=MlpKind.MOE`, an MoE block in `model.py` (router + experts stacked on a leading expert axis)
  and table entries with an `{expert}` placeholder whose target is one row of that stacked parameter.
- RoPE types: default, linear and llama3. Others (yarn, dynamic, longrope) are refused, not approximated.
- Sliding-window attention is not implemented; a config that would use it within `max_model_len` is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class Bias(enum.Enum):
    """Whether a projection carries a bias."""

    NEVER = "never"
    ALWAYS = "always"
    FROM_CONFIG = "from_config"
    """Follows the HF config's `attention_bias` flag."""


class MlpKind(enum.Enum):
    """Which MLP block a decoder layer has."""

    DENSE = "dense"


@dataclass(frozen=True)
class ArchSpec:
    """The few ways one HF decoder architecture differs from the shared decoder."""

    hf_architecture: str
    """The HF `architectures` entry, e.g. `LlamaForCausalLM`."""
    model_type: str
    """The HF `model_type`, used when a config carries no `architectures` list."""
    qkv_bias: Bias = Bias.NEVER
    """Bias on the q, k and v projections (Qwen2: always)."""
    o_bias: Bias = Bias.NEVER
    """Bias on the output projection."""
    qk_norm: bool = False
    """Per-head RMSNorm on q and k before rotary embedding (Qwen3)."""
    mlp: MlpKind = MlpKind.DENSE
    """The MLP block of every layer."""


LLAMA = ArchSpec("LlamaForCausalLM", "llama", qkv_bias=Bias.FROM_CONFIG, o_bias=Bias.FROM_CONFIG)
MISTRAL = ArchSpec("MistralForCausalLM", "mistral")
QWEN2 = ArchSpec("Qwen2ForCausalLM", "qwen2", qkv_bias=Bias.ALWAYS)
QWEN3 = ArchSpec("Qwen3ForCausalLM", "qwen3", qkv_bias=Bias.FROM_CONFIG, o_bias=Bias.FROM_CONFIG, qk_norm=True)

ARCHITECTURES: dict[str, ArchSpec] = {spec.hf_architecture: spec for spec in (LLAMA, MISTRAL, QWEN2, QWEN3)}
"""The explicit registry, keyed by the HF `architectures` entry."""


def find_arch(hf: Mapping[str, Any]) -> ArchSpec:
    """The spec for an HF config: by its `architectures` entry, else by its `model_type`."""
    names = hf.get("architectures") or []
    for name in names:
        if name in ARCHITECTURES:
            return ARCHITECTURES[name]
    by_type = {spec.model_type: spec for spec in ARCHITECTURES.values()}
    if not names and hf.get("model_type") in by_type:
        return by_type[hf["model_type"]]
    raise NotImplementedError(
        f"unsupported architecture {names or hf.get('model_type')!r}; supported: {sorted(ARCHITECTURES)}"
    )


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding parameters, normalised from either HF spelling."""

    theta: float
    """The base wavelength (`rope_theta`)."""
    rope_type: str = "default"
    """`default`, `linear` or `llama3`."""
    factor: float = 1.0
    """The scaling factor (`linear`, `llama3`)."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are divided by `factor`."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """llama3: the context length the model was pre-trained with."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the shared decoder needs, read from an HF config."""

    arch: ArchSpec
    """The architecture's differences from the shared decoder."""
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
    """Width of one head (explicit in Qwen3 configs, else hidden_size // num_heads)."""
    rms_norm_eps: float
    """Epsilon of every RMSNorm."""
    rope: RopeConfig
    """Rotary embedding parameters."""
    tie_word_embeddings: bool
    """The output layer reuses the embedding matrix."""
    qkv_bias: bool
    """Resolved from `arch.qkv_bias` and the config."""
    o_bias: bool
    """Resolved from `arch.o_bias` and the config."""
    sliding_window: int | None
    """The attention window if the config declares one (checked against max_model_len, never applied)."""

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Reads a transformers `PretrainedConfig` or a config.json dict."""
        hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        arch = find_arch(hf)
        _refuse_unsupported(hf)
        heads = int(hf["num_attention_heads"])
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=int(hf["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=read_rope(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_resolve_bias(arch.qkv_bias, hf),
            o_bias=_resolve_bias(arch.o_bias, hf),
            sliding_window=_sliding_window(hf),
        )


def _resolve_bias(rule: Bias, hf: Mapping[str, Any]) -> bool:
    if rule is Bias.FROM_CONFIG:
        return bool(hf.get("attention_bias") or False)
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
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError("partial_rotary_factor != 1 is not implemented")
    if rope_type == "default":
        return RopeConfig(theta=float(params["rope_theta"]))
    if rope_type == "linear":
        return RopeConfig(theta=float(params["rope_theta"]), rope_type="linear", factor=float(params["factor"]))
    return RopeConfig(
        theta=float(params["rope_theta"]),
        rope_type="llama3",
        factor=float(params["factor"]),
        low_freq_factor=float(params["low_freq_factor"]),
        high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
    )


LAYER = "model.layers.{layer}"


@dataclass(frozen=True)
class Direct:
    """An HF tensor that is one engine parameter of the same name."""

    name: str


@dataclass(frozen=True)
class FusedQKV:
    """The engine's `qkv_proj` parameter: rows of q, then k, then v (HF's own order, unlike megatron-core)."""

    target: str
    q: str
    k: str
    v: str


@dataclass(frozen=True)
class FusedGateUp:
    """The engine's `gate_up_proj` parameter: the gate rows, then the up rows."""

    target: str
    gate: str
    up: str


Entry = Direct | FusedQKV | FusedGateUp


def weight_table(cfg: ModelConfig) -> tuple[Entry, ...]:
    """Every HF tensor of the model and where it goes; `{layer}` stands for the layer index."""
    table: list[Entry] = [
        Direct("model.embed_tokens.weight"),
        Direct("model.norm.weight"),
        Direct(f"{LAYER}.input_layernorm.weight"),
        Direct(f"{LAYER}.post_attention_layernorm.weight"),
        Direct(f"{LAYER}.self_attn.o_proj.weight"),
        Direct(f"{LAYER}.mlp.down_proj.weight"),
        _qkv("weight"),
        FusedGateUp(
            f"{LAYER}.mlp.gate_up_proj.weight",
            gate=f"{LAYER}.mlp.gate_proj.weight",
            up=f"{LAYER}.mlp.up_proj.weight",
        ),
    ]
    if cfg.qkv_bias:
        table.append(_qkv("bias"))
    if cfg.o_bias:
        table.append(Direct(f"{LAYER}.self_attn.o_proj.bias"))
    if cfg.arch.qk_norm:
        table += [Direct(f"{LAYER}.self_attn.q_norm.weight"), Direct(f"{LAYER}.self_attn.k_norm.weight")]
    if not cfg.tie_word_embeddings:
        table.append(Direct("lm_head.weight"))
    return tuple(table)


def ignored_names(cfg: ModelConfig) -> tuple[str, ...]:
    """HF names accepted and dropped: a tied output layer, and rotary buffers that old checkpoints saved."""
    names = [f"{LAYER}.self_attn.rotary_emb.inv_freq"]
    if cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    return tuple(names)


def _qkv(leaf: str) -> FusedQKV:
    return FusedQKV(
        f"{LAYER}.self_attn.qkv_proj.{leaf}",
        q=f"{LAYER}.self_attn.q_proj.{leaf}",
        k=f"{LAYER}.self_attn.k_proj.{leaf}",
        v=f"{LAYER}.self_attn.v_proj.{leaf}",
    )
