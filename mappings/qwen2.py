"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the Llama table plus q/k/v biases."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import HF_LAYER, MC_LAYER, TABLE
from hf_mcore_bridge.models.architecture import Architecture, Bias, EngineOptions
from hf_mcore_bridge.models.config_errors import refuse_if
from hf_mcore_bridge.models.mapping_types import Feature, FusedQKV


def check(config: Mapping[str, Any]) -> None:
    """Qwen2's optional sliding window is not representable."""
    refuse_if(config, "use_sliding_window", True)


QKV_BIAS = FusedQKV(
    f"{MC_LAYER}.self_attention.linear_qkv.bias",
    q=f"{HF_LAYER}.self_attn.q_proj.bias",
    k=f"{HF_LAYER}.self_attn.k_proj.bias",
    v=f"{HF_LAYER}.self_attn.v_proj.bias",
    tail=(),
    requires=Feature.QKV_BIAS,
)

ARCHITECTURE = Architecture(
    hf_name="Qwen2ForCausalLM",
    model_type="qwen2",
    table=(*TABLE, QKV_BIAS),
    qkv_bias=True,
    check=check,
    hf_defaults={"use_sliding_window": False},
    engine=EngineOptions(qkv_bias=Bias.ALWAYS),
    tiny={"rope_theta": 1000000.0},
)
