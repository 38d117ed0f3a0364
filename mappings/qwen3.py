"""Qwen3 (`Qwen3ForCausalLM`): the Llama table plus per-head RMSNorm on q and k, with an explicit head_dim;
`attention_bias` switches q/k/v and o_proj biases on (as Llama's), `use_sliding_window` its sliding window."""

from __future__ import annotations

from hf_mcore_bridge.mappings.llama import HF_LAYER, MC_LAYER, TABLE
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import Direct, Feature, Size
from hf_mcore_bridge.models.parallel_style import Parallel

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
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    sliding_window_switch="use_sliding_window",
    hf_defaults={"use_sliding_window": False, "attention_bias": False},
    tiny={"head_dim": 32, "rope_theta": 1000000.0},
)
