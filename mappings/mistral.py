"""Mistral (`MistralForCausalLM`): the Llama table; a set `sliding_window` is attention through that window."""

from __future__ import annotations

from hf_mcore_bridge.mappings.llama import TABLE
from hf_mcore_bridge.models.architecture import Architecture

ARCHITECTURE = Architecture(
    hf_name="MistralForCausalLM",
    model_type="mistral",
    table=TABLE,
    hf_defaults={"sliding_window": None},
    tiny={"sliding_window": None, "head_dim": 16},
)
