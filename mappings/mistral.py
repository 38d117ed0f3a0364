"""Mistral (`MistralForCausalLM`): the Llama table; sliding-window attention is refused."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import TABLE
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import refuse_unless


def check(config: Mapping[str, Any]) -> None:
    """Mistral 7B v0.1 attends through a 4096-token sliding window; megatron-core's dense GPT layers do not."""
    refuse_unless(config, "sliding_window", None)


ARCHITECTURE = Architecture(
    hf_name="MistralForCausalLM",
    model_type="mistral",
    table=TABLE,
    check=check,
    hf_defaults={"sliding_window": None},
    tiny={"sliding_window": None, "head_dim": 16},
)
