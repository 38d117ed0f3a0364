"""Qwen3 (`Qwen3ForCausalLM`): the Llama table plus per-head RMSNorm on q and k, with an explicit head_dim."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import HF_LAYER, MC_LAYER, TABLE
from hf_mcore_bridge.models.architecture import Architecture, Bias, EngineOptions
from hf_mcore_bridge.models.config_errors import refuse_if
from hf_mcore_bridge.models.mapping_types import Direct, Feature, Size
from hf_mcore_bridge.models.parallel_style import Parallel


def check(config: Mapping[str, Any]) -> None:
    """Qwen3's attention bias would also bias `o_proj`, and its optional sliding window is not representable."""
    refuse_if(config, "attention_bias", True)
    refuse_if(config, "use_sliding_window", True)


QK_NORMS = (
    Direct(
        f"{MC_LAYER}.self_attention.q_layernorm.weight",
        f"{HF_LAYER}.self_attn.q_norm.weight",
        Parallel.REPLICATED,
        (Size.HEAD_DIM,),
        requires=Feature.QK_NORM,
    ),
    Direct(
        f"{MC_LAYER}.self_attention.k_layernorm.weight",
        f"{HF_LAYER}.self_attn.k_norm.weight",
        Parallel.REPLICATED,
        (Size.HEAD_DIM,),
        requires=Feature.QK_NORM,
    ),
)

ARCHITECTURE = Architecture(
    hf_name="Qwen3ForCausalLM",
    model_type="qwen3",
    table=(*TABLE, *QK_NORMS),
    qk_norm=True,
    check=check,
    hf_defaults={"use_sliding_window": False, "attention_bias": False},
    engine=EngineOptions(qkv_bias=Bias.FROM_CONFIG, o_bias=Bias.FROM_CONFIG),
    tiny={"head_dim": 32, "rope_theta": 1000000.0},
)
