"""Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`): the Llama table plus q/k/v biases; `use_sliding_window` switches its
sliding window on."""

from __future__ import annotations

from hf_mcore_bridge.mappings.llama import HF_LAYER, MC_LAYER, TABLE
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import Feature, FusedQKV

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
    sliding_window_switch="use_sliding_window",
    hf_defaults={"use_sliding_window": False},
    tiny={"rope_theta": 1000000.0},
)
