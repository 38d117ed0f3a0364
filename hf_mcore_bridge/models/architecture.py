"""What an architecture file in `mappings/` declares: everything that differs between architectures.

An `Architecture` holds its HF names, its mapping table (every tensor, both naming schemes, with its parallel
style), the hooks of the HF config <-> megatron-core translation (refusals, mixture-of-experts fields, fields
written back on export), the few options of the engine's shared decoder that are not in the table (`EngineOptions`)
and its tiny test configuration. Conversion, export, verify, the engine, the DTensor path and the trainer all read
it from one registry (`models.registry`); nothing else branches on an architecture's name.

Optional parts that an HF config switches on per checkpoint (GLM-4.5's q/k norms and q/k/v biases) are a
`Switch`: the name of the config field; table entries of such a part say so (`mapping_types.Feature`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.models.mapping_types import Entry, LayerKind, Size

if TYPE_CHECKING:
    from hf_mcore_bridge.models.moe import MoeConfig

Switch = bool | str
"""Whether an architecture has an optional part: always (True), never (False), or where the HF config field of
this name is true (absent: false, unless `Architecture.hf_absent` says otherwise)."""


class Bias(enum.Enum):
    """Whether the engine gives a projection a bias (HF configs switch some of them on per checkpoint)."""

    NEVER = "never"
    ALWAYS = "always"
    FROM_CONFIG = "from_config"
    """Follows the HF config's `attention_bias` flag."""
    FROM_QKV_BIAS = "from_qkv_bias"
    """Follows the HF config's `qkv_bias` flag, true when absent (Qwen2-MoE)."""


@dataclass(frozen=True)
class EngineOptions:
    """What the engine's shared decoder needs beyond the mapping table (whose HF names it loads from)."""

    qkv_bias: Bias = Bias.NEVER
    """Bias on the q, k and v projections. Where the table has no q/k/v bias entry but the config asks for one
    (Llama's `attention_bias`), the engine derives its names from the q/k/v weights'."""
    o_bias: Bias = Bias.NEVER
    """Bias on the output projection (`o_proj.bias`, a name derived from `o_proj.weight`)."""
    round_routing_weights: bool = False
    """Routing weights are rounded to the activation dtype before they scale the expert outputs (Qwen); Mixtral
    scales in float32 and rounds the product. Identical in float32."""
    latent_norm_eps: float | None = None
    """Multi-latent attention: the epsilon of the query and key/value latents' RMSNorms (`q_a_layernorm`,
    `kv_a_layernorm`); None: `rms_norm_eps`. HF's DeepSeek-V3 hard-codes 1e-6."""


@dataclass(frozen=True)
class Architecture:
    """A decoder-only architecture of the Llama family, dense or mixture-of-experts."""

    hf_name: str
    """The HF `architectures` entry, e.g. `LlamaForCausalLM`."""
    model_type: str
    """The HF `model_type`, e.g. `llama`."""
    table: tuple[Entry, ...]
    """The mapping table: every tensor of the model, in both naming schemes."""
    qkv_bias: Switch = False
    """Biases on q/k/v (megatron `add_qkv_bias`), as in Qwen2; GLM-4.5 switches them with `attention_bias`."""
    qk_norm: Switch = False
    """RMSNorm on each head of q and k (megatron `qk_layernorm`), as in Qwen3; GLM-4.5 switches it with
    `use_qk_norm`."""
    check: Callable[[Mapping[str, Any]], None] | None = None
    """Refuses HF config values this architecture has but megatron-core cannot represent (raises `ConfigError`)."""
    hf_defaults: Mapping[str, Any] | None = None
    """Architecture-specific HF config fields written on export (e.g. Mistral's `sliding_window: null`)."""
    hf_absent: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The values transformers gives fields a `config.json` lacks, where they matter to the conversion (GLM-4.5:
    `partial_rotary_factor` 0.5, `first_k_dense_replace` 1): read configs as transformers would run them."""
    hf_size_fields: Mapping[Size, str] = field(default_factory=lambda: MappingProxyType({}))
    """The HF config fields a model dimension comes from, where they are not the usual ones (`input_checks`
    names them in its messages)."""
    score_function: str = "softmax"
    """The router score function its MoE layers use (`MoeConfig.score_function`): how Megatron `args` that name
    no architecture find it (`registry.with_features`), and what export refuses to write otherwise."""
    moe_from_hf: Callable[[Mapping[str, Any], int], MoeConfig] | None = None
    """Reads the mixture-of-experts fields of an HF config (given the layer count); None for dense models."""
    moe_to_hf: Callable[[MoeConfig], dict[str, Any]] | None = None
    """Writes the mixture-of-experts fields back into an HF config."""
    fused_experts: Mapping[str, tuple[str, str]] | None = None
    """Alternative HF layouts to read: per-expert name template -> (fused `[num_experts, ...]` tensor template,
    part: `gate` / `up` half of dim 1, or `all`). Export always writes the per-expert names."""
    mtp_copies: Mapping[str, str] | None = None
    """A multi-token-prediction layer's own copies of model tensors that megatron-core's MTP shares: HF name
    template (with `{layer}`) -> the HF name of the shared tensor (`embed_tokens` and `shared_head.head` of
    DeepSeek-V3's and GLM-4.5's MTP layers). Checked equal on import, written again on export."""
    engine: EngineOptions = EngineOptions()
    """The engine decoder's options beyond the table."""
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
