"""Per-architecture data for the engine's one shared decoder, and the HF weight-name table it loads from.

Every supported architecture is the same pre-norm decoder (RMSNorm, rotary attention with grouped KV heads,
SiLU-gated MLP or a mixture of SiLU-gated experts); what differs is data on an `ArchSpec`: which projections carry
a bias, whether q and k get a per-head RMSNorm, and for a mixture-of-experts model a `MoeSpec` (HF names of the
block and its experts, how routing weights are normalised, whether a gated shared expert runs beside the routed
ones). `ModelConfig.from_hf` reads an HF config (a `PretrainedConfig` or its dict) into the frozen `ModelConfig`
the decoder is built from, refusing values the decoder would silently get wrong.

`weight_table` lists, once, every HF tensor name (with `{layer}` and `{expert}` placeholders) of a layer with a
given MLP kind and the engine parameter it fills: `Direct` entries copy a whole tensor, `FusedQKV` / `FusedGateUp`
entries name the HF sources that are stacked, in row order, into the engine's fused `qkv_proj` / `gate_up_proj`
parameters, and `ExpertSlice` / `ExpertGateUp` entries fill slice `[expert]` of a parameter stacked on a leading
expert axis (`experts.w2` [E, H, F]; `experts.w13` [E, 2F, H], gate rows then up rows, HF's own fused layout).
Each entry also names its tensor-parallel style (`parallel_style.Parallel`: fused q/k/v and gate/up are column
parallel by construction; `Direct` and `ExpertSlice` say ROW, VOCAB or REPLICATED).

Simplifications and how to extend:
- Mixture of experts: softmax routing over all experts, then top-k (Mixtral, Qwen2-MoE, Qwen3-MoE). Layer
  placement follows the Qwen keys (`mlp_only_layers`, `decoder_sparse_step`); a config without them (Mixtral) has
  experts in every layer. Another architecture with this routing is one more `ArchSpec` with a `MoeSpec`; grouped
  or sigmoid routing with expert score biases (DeepSeek-V3) would need a new routing function and is not
  implemented. `router_jitter_noise` and the auxiliary load-balancing loss are training-only and ignored.
- Experts load from HF's per-expert names (the layout saved on the Hub) and from the fused in-memory names of a
  transformers-5 model (`mlp.experts.gate_up_proj` [E, 2F, H], gate rows then up rows; `mlp.experts.down_proj`
  [E, H, F]; Mixtral's router as `mlp.gate.weight`): `fused_expert_pieces` splits those into the per-expert names
  with the conversion's own rules (`Architecture.fused_experts` in `mappings/`), so there is one name table.
- RoPE types: default, linear and llama3. Others (yarn, dynamic, longrope) are refused, not approximated.
- Sliding-window attention is not implemented; a config that would use it within `max_model_len` is refused.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from hf_mcore_bridge.convert.parallel_style import Parallel


class Bias(enum.Enum):
    """Whether a projection carries a bias."""

    NEVER = "never"
    ALWAYS = "always"
    FROM_CONFIG = "from_config"
    """Follows the HF config's `attention_bias` flag."""
    FROM_QKV_BIAS = "from_qkv_bias"
    """Follows the HF config's `qkv_bias` flag, true when absent (Qwen2-MoE)."""


class MlpKind(enum.Enum):
    """Which MLP block a decoder layer has."""

    DENSE = "dense"
    """One SiLU-gated MLP of width `intermediate_size`."""
    MOE = "moe"
    """A router, routed experts stacked on a leading expert axis, and optionally a gated shared expert."""


@dataclass(frozen=True)
class MoeSpec:
    """How one mixture-of-experts architecture names and routes its experts."""

    block: str
    """The HF module of the MoE block inside a layer: `block_sparse_moe` (Mixtral) or `mlp` (Qwen)."""
    gate_proj: str
    """HF name of an expert's gate projection (`w1` in Mixtral)."""
    up_proj: str
    """HF name of an expert's up projection (`w3` in Mixtral)."""
    down_proj: str
    """HF name of an expert's down projection (`w2` in Mixtral)."""
    width_key: str
    """The config key of an expert's width: `intermediate_size` (Mixtral) or `moe_intermediate_size` (Qwen)."""
    renormalize: bool | None
    """Renormalise the top-k routing weights to sum to 1; None follows the config's `norm_topk_prob` (default
    false)."""
    round_routing_weights: bool
    """Routing weights are rounded to the activation dtype before they scale the expert outputs (Qwen); Mixtral
    scales in float32 and rounds the product. Identical in float32."""
    shared_expert: bool = False
    """A SiLU-gated shared expert on every token, scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""


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
    moe: MoeSpec | None = None
    """The mixture of experts, for a MoE architecture; None: every layer has a dense MLP."""


_QWEN_MOE = MoeSpec(
    block="mlp",
    gate_proj="gate_proj",
    up_proj="up_proj",
    down_proj="down_proj",
    width_key="moe_intermediate_size",
    renormalize=None,
    round_routing_weights=True,
)

LLAMA = ArchSpec("LlamaForCausalLM", "llama", qkv_bias=Bias.FROM_CONFIG, o_bias=Bias.FROM_CONFIG)
MISTRAL = ArchSpec("MistralForCausalLM", "mistral")
QWEN2 = ArchSpec("Qwen2ForCausalLM", "qwen2", qkv_bias=Bias.ALWAYS)
QWEN3 = ArchSpec("Qwen3ForCausalLM", "qwen3", qkv_bias=Bias.FROM_CONFIG, o_bias=Bias.FROM_CONFIG, qk_norm=True)
MIXTRAL = ArchSpec(
    "MixtralForCausalLM",
    "mixtral",
    moe=MoeSpec(
        block="block_sparse_moe",
        gate_proj="w1",
        up_proj="w3",
        down_proj="w2",
        width_key="intermediate_size",
        renormalize=True,
        round_routing_weights=False,
    ),
)
QWEN2_MOE = ArchSpec(
    "Qwen2MoeForCausalLM", "qwen2_moe", qkv_bias=Bias.FROM_QKV_BIAS, moe=replace(_QWEN_MOE, shared_expert=True)
)
QWEN3_MOE = ArchSpec(
    "Qwen3MoeForCausalLM", "qwen3_moe", qkv_bias=Bias.FROM_CONFIG, o_bias=Bias.FROM_CONFIG, qk_norm=True, moe=_QWEN_MOE
)

ARCHITECTURES: dict[str, ArchSpec] = {
    spec.hf_architecture: spec for spec in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN2_MOE, QWEN3_MOE)
}
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
    """Intermediate width of the gated shared expert; None when there is none."""
    layers: frozenset[int]
    """The layers with a MoE block; the others have a dense MLP of width `intermediate_size`."""

    @classmethod
    def from_hf(cls, spec: MoeSpec, hf: Mapping[str, Any], num_layers: int) -> MoeConfig:
        experts = int(hf.get("num_experts") or hf.get("num_local_experts") or 0)
        top_k = int(hf["num_experts_per_tok"])
        if not 0 < top_k <= experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and the number of experts ({experts})")
        renormalize = spec.renormalize if spec.renormalize is not None else bool(hf.get("norm_topk_prob", False))
        return cls(
            num_experts=experts,
            top_k=top_k,
            expert_width=int(hf[spec.width_key]),
            renormalize=renormalize,
            round_routing_weights=spec.round_routing_weights,
            shared_expert_width=int(hf["shared_expert_intermediate_size"]) if spec.shared_expert else None,
            layers=moe_layers(hf, num_layers),
        )


def moe_layers(hf: Mapping[str, Any], num_layers: int) -> frozenset[int]:
    """Layers with experts: every `decoder_sparse_step`-th layer (1-based) that is not in `mlp_only_layers`."""
    step = int(hf.get("decoder_sparse_step") or 1)
    dense = {int(layer) for layer in hf.get("mlp_only_layers") or ()}
    return frozenset(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


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
    moe: MoeConfig | None = None
    """The mixture of experts; None for a dense model."""

    def mlp_kind(self, layer: int) -> MlpKind:
        """The MLP block of one decoder layer."""
        return MlpKind.MOE if self.moe is not None and layer in self.moe.layers else MlpKind.DENSE

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Reads a transformers `PretrainedConfig` or a config.json dict."""
        hf = hf_config.to_dict() if hasattr(hf_config, "to_dict") else dict(hf_config)
        arch = find_arch(hf)
        _refuse_unsupported(hf)
        heads = int(hf["num_attention_heads"])
        num_layers = int(hf["num_hidden_layers"])
        return cls(
            arch=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(hf.get("head_dim") or hf["hidden_size"] // heads),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=read_rope(hf),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=_resolve_bias(arch.qkv_bias, hf),
            o_bias=_resolve_bias(arch.o_bias, hf),
            sliding_window=_sliding_window(hf),
            moe=MoeConfig.from_hf(arch.moe, hf, num_layers) if arch.moe is not None else None,
        )


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
EXPERT = "{expert}"


@dataclass(frozen=True)
class Direct:
    """An HF tensor that is one whole engine parameter."""

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
    """Every HF tensor of a model whose layers have `mlp` blocks, and where it goes.

    `{layer}` stands for the layer index, `{expert}` for the expert index; entries without `{layer}` are the
    model's own (embedding, final norm, output layer).
    """
    table: list[Entry] = [
        Direct("model.embed_tokens.weight", parallel=Parallel.VOCAB),
        Direct("model.norm.weight"),
        Direct(f"{LAYER}.input_layernorm.weight"),
        Direct(f"{LAYER}.post_attention_layernorm.weight"),
        Direct(f"{LAYER}.self_attn.o_proj.weight", parallel=Parallel.ROW),
        _qkv("weight"),
    ]
    if cfg.qkv_bias:
        table.append(_qkv("bias"))
    if cfg.o_bias:
        table.append(Direct(f"{LAYER}.self_attn.o_proj.bias"))
    if cfg.arch.qk_norm:
        table += [Direct(f"{LAYER}.self_attn.q_norm.weight"), Direct(f"{LAYER}.self_attn.k_norm.weight")]
    if not cfg.tie_word_embeddings:
        table.append(Direct("lm_head.weight", parallel=Parallel.VOCAB))
    if mlp is MlpKind.DENSE:
        table += _gated_mlp(f"{LAYER}.mlp", cfg.intermediate_size)
    else:
        table += _moe(cfg)
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


def _gated_mlp(prefix: str, width: int) -> list[Entry]:
    """A SiLU-gated MLP with HF's `gate_proj` / `up_proj` / `down_proj` names under `prefix`."""
    return [
        FusedGateUp(
            f"{prefix}.gate_up_proj.weight",
            gate=f"{prefix}.gate_proj.weight",
            up=f"{prefix}.up_proj.weight",
            width=width,
        ),
        Direct(f"{prefix}.down_proj.weight", parallel=Parallel.ROW),
    ]


def _moe(cfg: ModelConfig) -> list[Entry]:
    """Router, stacked routed experts and (Qwen2-MoE) the gated shared expert; the engine's block is `mlp`."""
    spec, moe = cfg.arch.moe, cfg.moe
    assert spec is not None and moe is not None
    hf_block, block = f"{LAYER}.{spec.block}", f"{LAYER}.mlp"
    expert = f"{hf_block}.experts.{EXPERT}"
    table: list[Entry] = [
        Direct(f"{hf_block}.gate.weight", target=f"{block}.gate.weight"),
        ExpertGateUp(
            f"{block}.experts.w13",
            gate=f"{expert}.{spec.gate_proj}.weight",
            up=f"{expert}.{spec.up_proj}.weight",
            width=moe.expert_width,
        ),
        ExpertSlice(f"{block}.experts.w2", source=f"{expert}.{spec.down_proj}.weight", parallel=Parallel.ROW),
    ]
    if moe.shared_expert_width is not None:
        table += _gated_mlp(f"{block}.shared_expert", moe.shared_expert_width)
        table.append(Direct(f"{block}.shared_expert_gate.weight"))
    return table


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
    from hf_mcore_bridge.convert.mapping_types import fill
    from hf_mcore_bridge.mappings import get_architecture

    rules = get_architecture(cfg.arch.hf_architecture).fused_experts or {}
    pieces: dict[str, list[FusedPiece]] = {}
    for layer in sorted(cfg.moe.layers):
        for template, (fused_template, part) in rules.items():
            experts = range(cfg.moe.num_experts) if EXPERT in template else (None,)
            for expert in experts:
                fused = fill(fused_template, layer, expert)
                pieces.setdefault(fused, []).append(FusedPiece(fill(template, layer, expert), expert, part))
    return {name: tuple(found) for name, found in pieces.items()}
