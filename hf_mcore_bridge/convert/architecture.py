"""What an architecture file in `mappings/` declares: everything that differs between architectures.

An `Architecture` holds its HF names, its mapping table (every tensor, both naming schemes, with its parallel
style), the hooks of the HF config <-> megatron-core translation (refusals, mixture-of-experts fields, fields
written back on export), the few options of the engine's shared decoder that are not in the table (`EngineOptions`)
and its tiny test configuration. Conversion, export, verify, the engine, the DTensor path and the trainer all read
it from one registry (`hf_mcore_bridge.mappings`); nothing else branches on an architecture's name.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.convert.mapping_types import Entry, Size

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.config_bridge import MoeConfig


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


@dataclass(frozen=True)
class Architecture:
    """A decoder-only architecture of the Llama family, dense or mixture-of-experts."""

    hf_name: str
    """The HF `architectures` entry, e.g. `LlamaForCausalLM`."""
    model_type: str
    """The HF `model_type`, e.g. `llama`."""
    table: tuple[Entry, ...]
    """The mapping table: every tensor of the model, in both naming schemes."""
    qkv_bias: bool = False
    """Biases on q/k/v (megatron `add_qkv_bias`), as in Qwen2."""
    qk_norm: bool = False
    """RMSNorm on each head of q and k (megatron `qk_layernorm`), as in Qwen3."""
    check: Callable[[Mapping[str, Any]], None] | None = None
    """Refuses HF config values this architecture has but megatron-core cannot represent (raises `ConfigError`)."""
    hf_defaults: Mapping[str, Any] | None = None
    """Architecture-specific HF config fields written on export (e.g. Mistral's `sliding_window: null`)."""
    moe_from_hf: Callable[[Mapping[str, Any], int], MoeConfig] | None = None
    """Reads the mixture-of-experts fields of an HF config (given the layer count); None for dense models."""
    moe_to_hf: Callable[[MoeConfig], dict[str, Any]] | None = None
    """Writes the mixture-of-experts fields back into an HF config."""
    fused_experts: Mapping[str, tuple[str, str]] | None = None
    """Alternative HF layouts to read: per-expert name template -> (fused `[num_experts, ...]` tensor template,
    part: `gate` / `up` half of dim 1, or `all`). Export always writes the per-expert names."""
    mtp_copies: Mapping[str, str] | None = None
    """A multi-token-prediction layer's own copies of model tensors that megatron-core's MTP shares: HF name
    template (with `{layer}`) -> the HF name of the shared tensor (DeepSeek-V3's `embed_tokens` and
    `shared_head.head` of its MTP layer). Checked equal on import, written again on export."""
    own_dtype: tuple[str, ...] = ()
    """HF name templates of tensors that keep the dtype they are stored in, outside `--dtype` and the one-dtype
    check: what HF keeps in float32 whatever the model's dtype (`_keep_in_fp32_modules_strict`, e.g. DeepSeek-V3's
    router and its expert-score correction bias, float32 in its bfloat16 checkpoints)."""
    engine: EngineOptions = EngineOptions()
    """The engine decoder's options beyond the table."""
    tiny: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """The tiny test model: HF config fields over `tiny_models.TINY_BASE` (small, but exercising what conversions
    get wrong: grouped KV heads, an odd vocabulary, this architecture's own features)."""

    @property
    def is_moe(self) -> bool:
        """Whether the architecture has routed experts."""
        return self.moe_from_hf is not None

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
