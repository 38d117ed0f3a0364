"""What an architecture file in `mappings/` declares: everything that differs between architectures.

An `Architecture` holds its HF names, its mapping table (every tensor, both naming schemes, with its parallel
style), how its HF config is read where that differs between families (which config fields switch optional parts
on, the values transformers gives absent fields, the mixture-of-experts reader and writer), the few facts of
transformers' model of it that no config field states (how routing weights are rounded, the latent norms'
epsilon) and its tiny test configuration. The model description (`models.spec.ModelSpec`) is read through it;
conversion, export, verify, the engine, the DTensor path and the trainer all find it in one registry
(`models.registry`); nothing else branches on an architecture's name.

Optional parts that an HF config switches on per checkpoint (GLM-4.5's q/k norms and q/k/v biases, Llama's
`attention_bias`) are a `Switch`: the name of the config field; table entries of such a part say so
(`mapping_types.Feature`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from hf_mcore_bridge.models.mapping_types import Entry, Feature, LayerKind, Size
from hf_mcore_bridge.models.moe import MoeSpec

Switch = bool | str
"""Whether an architecture has an optional part: always (True), never (False), or where the HF config field of
this name is true (absent: false, unless `Architecture.hf_absent` says otherwise)."""


@dataclass(frozen=True)
class Architecture:
    """A decoder-only architecture of the Llama family, dense or mixture-of-experts."""

    hf_name: str
    """The HF `architectures` entry, e.g. `LlamaForCausalLM`."""
    model_type: str
    """The HF `model_type`, e.g. `llama`."""
    table: tuple[Entry, ...]
    """The mapping table: every tensor of the model, in both naming schemes."""
    other_model_types: tuple[str, ...] = ()
    """Other `model_type`s of configs of this architecture (Kimi-K2's `kimi_k2`, a DeepSeek-V3): a config naming no
    `architectures` is found by them too; export keeps the config's own."""
    qkv_bias: Switch = False
    """Biases on q/k/v, as in Qwen2; Llama, Qwen3 and GLM-4.5 switch them with `attention_bias`, Qwen2-MoE with
    `qkv_bias`. Where the table has no q/k/v bias entries (Llama, Qwen3), the engine derives their names from the
    weights' and conversion refuses them."""
    o_bias: Switch = False
    """A bias on the attention's output projection (`o_proj.bias`, a name derived from `o_proj.weight`): Llama's
    and Qwen3's `attention_bias` (GLM-4.5's leaves `o_proj` without one)."""
    qk_norm: Switch = False
    """RMSNorm on each head of q and k (megatron `qk_layernorm`), as in Qwen3; GLM-4.5 switches it with
    `use_qk_norm`."""
    attention_sinks: bool = False
    """A learnable logit per query head joins every softmax denominator and takes no value (GPT-OSS's
    `self_attn.sinks`; megatron-core's `softmax_type='learnable'`, its `core_attention.softmax_offset`)."""
    sliding_window_switch: str | None = None
    """The config field that switches sliding-window attention on (Qwen's `use_sliding_window`); None: a set
    `sliding_window` is on (Mistral)."""
    hidden_act_field: str = "hidden_act"
    """The config field naming the gated MLP's activation (Gemma 3's `hidden_activation`)."""
    norm_offset: bool = False
    """Every RMSNorm scales by `1 + weight`, its stored weight the offset from one (Gemma's norms; megatron-core's
    `layernorm_zero_centered_gamma`)."""
    post_norms: bool = False
    """RMSNorms on the attention's and the MLP's outputs before each residual add (Gemma 3's
    `post_attention_layernorm` and `post_feedforward_layernorm`; its pre-MLP norm is `pre_feedforward_layernorm`)."""
    embedding_scale: bool = False
    """The embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype (Gemma)."""
    sliding_rope_theta: str | None = None
    """The config field of the RoPE base of the `sliding_attention` layers, where they have their own (Gemma 3's
    `rope_local_base_freq`; transformers 5 writes it into `rope_parameters.sliding_attention`)."""
    softmax_scale_field: str | None = None
    """The config field whose inverse square root is the attention's softmax scale (Gemma 3's
    `query_pre_attn_scalar`); None: head_dim^-0.5."""
    refused_when_set: tuple[str, ...] = ()
    """Config fields the description has no place for, refused by name where set (Gemma 3's logit soft-capping)."""
    linear_attention: bool = False
    """Gated DeltaNet linear attention on the layers `layer_types` marks `linear_attention` (Qwen3-Next, Qwen3.5:
    its `linear_*` config fields, `models.spec.LinearAttentionSpec`); where a config lacks `layer_types`, the layers
    `full_attention_period` does not mark full are linear rather than sliding."""
    attention_output_gate: bool = False
    """The full-attention layers' query projection also holds a sigmoid gate on the attention's output, per head
    (Qwen3-Next, Qwen3.5; megatron-core's `attention_output_gate`)."""
    full_attention_period: str | None = None
    """The config field from which transformers derives `layer_types` where a config lacks them: every layer whose
    1-based number it divides is full attention, the others sliding (Gemma 3's `sliding_window_pattern`, 6 where
    absent); None: no `layer_types` means every layer full."""
    hf_defaults: Mapping[str, Any] | None = None
    """Architecture-specific HF config fields written on export (e.g. Mistral's `sliding_window: null`)."""
    hf_absent: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The values transformers gives fields a `config.json` lacks, where they matter to the model (GLM-4.5:
    `partial_rotary_factor` 0.5, `first_k_dense_replace` 1): read configs as transformers would run them."""
    hf_size_fields: Mapping[Size, str] = field(default_factory=lambda: MappingProxyType({}))
    """The HF config fields a model dimension comes from, where they are not the usual ones (`input_checks`
    names them in its messages)."""
    score_function: str = "softmax"
    """The router score function its MoE layers use (`MoeSpec.score_function`): how Megatron `args` that name
    no architecture find it (`registry.with_features`), and what export refuses to write otherwise."""
    moe_from_hf: Callable[[Mapping[str, Any], int], MoeSpec] | None = None
    """Reads the mixture-of-experts fields of an HF config (given the layer count); None for dense models. Refuses
    only what it cannot describe (`ConfigError`): consumers refuse what they cannot compute."""
    moe_to_hf: Callable[[MoeSpec], dict[str, Any]] | None = None
    """Writes the mixture-of-experts fields back into an HF config."""
    round_routing_weights: bool = False
    """transformers' model rounds the routing weights to the activation dtype before they scale the expert
    outputs (Qwen); otherwise it scales in float32 and rounds the product (Mixtral). Identical in float32."""
    latent_norm_eps: float | None = None
    """Multi-latent attention: the epsilon transformers' model gives the query and key/value latents' RMSNorms
    (`q_a_layernorm`, `kv_a_layernorm`) whatever the config says (DeepSeek-V3: 1e-6); None: `rms_norm_eps`."""
    fused_checkpoint: bool = False
    """The HF checkpoint itself stores the experts fused (`fused_experts`' fused names, GPT-OSS's published
    weights): export writes them so, one expert's slice at a time; otherwise export writes the per-expert names."""
    fused_experts: Mapping[str, tuple[str, str]] | None = None
    """transformers 5's in-memory names, where they differ from the checkpoint's: per-expert name template ->
    (fused `[num_experts, ...]` tensor template, part: `gate` / `up` half of dim 1, `all` (Mixtral's router
    renamed whole), or another of `checkpoint.expert_parts.PARTS`). Conversion and the engine read either
    layout; export writes the checkpoint's names (`fused_checkpoint`). The engine's stacked expert parameters
    carry the fused names."""
    mtp_copies: Mapping[str, str] | None = None
    """A multi-token-prediction layer's own copies of model tensors that megatron-core's MTP shares: HF name
    template (with `{layer}`) -> the HF name of the shared tensor (`embed_tokens` and `shared_head.head` of
    DeepSeek-V3's and GLM-4.5's MTP layers). Checked equal on import, written again on export."""
    tiny: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The tiny test model: HF config fields over `tiny_models.TINY_BASE` (small, but exercising what conversions
    get wrong: grouped KV heads, an odd vocabulary, this architecture's own features)."""

    def with_absent(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The HF config with `hf_absent`'s values where it lacks the field."""
        return {**self.hf_absent, **config}

    def switched_on(self, switch: Switch, config: Mapping[str, Any]) -> bool:
        """Whether an optional part (`qkv_bias`, `qk_norm`) is on in this HF config."""
        if isinstance(switch, bool):
            return switch
        return bool(self.with_absent(config).get(switch) or False)

    def table_has(self, feature: Feature) -> bool:
        """Whether the table has entries of an optional part (q/k/v biases, q/k norms, ...)."""
        return any(entry.requires is feature for entry in self.table)

    @property
    def is_moe(self) -> bool:
        """Whether the architecture has routed experts."""
        return self.moe_from_hf is not None

    @property
    def has_mtp(self) -> bool:
        """Whether it has multi-token-prediction layers (table entries of `LayerKind.MTP`)."""
        return any(entry.layers is LayerKind.MTP for entry in self.table)

    @property
    def multi_latent(self) -> bool:
        """Whether its attention is multi-latent (a table entry of the key/value latent's width)."""
        return any(Size.KV_LORA in _sizes(entry) or Size.KV_DOWN in _sizes(entry) for entry in self.table)

    @property
    def has_shared_expert(self) -> bool:
        """Whether its MoE layers have a shared expert beside the routed ones (a table entry of that width)."""
        return any(Size.SHARED_FFN in _sizes(entry) for entry in self.table)


def _sizes(entry: Entry) -> set[Size]:
    return {size for shape in entry.hf_expected().values() for size in shape}
