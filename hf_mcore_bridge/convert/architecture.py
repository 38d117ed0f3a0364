"""What an architecture file in `mappings/` declares: its HF names, its mapping table and a few named hooks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.convert.mapping_types import Entry

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.config_bridge import MoeConfig


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
