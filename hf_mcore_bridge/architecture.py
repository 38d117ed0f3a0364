"""What an architecture file in `mappings/` declares: its HF names, its mapping table and a few named hooks."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.mapping_types import Entry


@dataclass(frozen=True)
class Architecture:
    """A dense decoder-only architecture of the Llama family."""

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
