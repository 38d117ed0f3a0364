"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (`Glm4MoeForCausalLM`): Llama attention with q/k/v biases (no `o_proj` bias)
and optional per-head q/k norms, partial rotary embeddings, a sigmoid router with expert score bias and
group-limited top-k, an ungated shared expert, and dense layers before the first MoE layer.

`attention_bias` and `use_qk_norm` switch their tensors per checkpoint (GLM-4.5 has both, GLM-4.5-Air only the
biases). The shared expert is `n_shared_experts` experts' width fused into one MLP, as transformers builds it.
Multi-token-prediction layers (`num_nextn_predict_layers`) map onto megatron-core's MTP as DeepSeek-V3's do
(`moe_tables.mtp_layer`, `convert.mtp`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import ATTENTION, DENSE_MLP
from hf_mcore_bridge.mappings.qwen2 import QKV_BIAS
from hf_mcore_bridge.mappings.qwen3 import QK_NORMS
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS, HF_MOE, ROUTED
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import ConfigError, require
from hf_mcore_bridge.models.mapping_types import Size
from hf_mcore_bridge.models.moe import (
    MoeSpec,
    leading_dense_count,
    leading_dense_layers,
    sigmoid_router,
    sigmoid_router_to_hf,
    topk,
)
from hf_mcore_bridge.models.moe_tables import MTP_COPIES, dense_only, expert_score_bias, mtp_layer, shared_experts

DENSE_LAYERS = "first_k_dense_replace"


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """`n_routed_experts` experts of width `moe_intermediate_size`, the sigmoid router (`sigmoid_router`), one
    shared expert `n_shared_experts` times as wide, and `first_k_dense_replace` dense layers first."""
    experts = require(config, "n_routed_experts")
    k = topk(config, experts)
    width = require(config, "moe_intermediate_size")
    shared = require(config, "n_shared_experts")
    if not isinstance(shared, int) or shared < 1:
        raise ConfigError(f"config field n_shared_experts={shared!r} is not supported (at least 1 shared expert)")
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=width,
        topk=k,
        moe_layers=leading_dense_layers(config, num_layers, DENSE_LAYERS),
        aux_loss_coeff=0.0,  # GLM's configs carry no auxiliary-loss coefficient
        shared_expert_size=shared * width,
        **sigmoid_router(config, experts, k),
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    shared = moe.shared_expert_size or 0
    if shared % moe.ffn_hidden_size or not shared:
        raise ConfigError(
            f"a shared expert of width {shared} is not a whole number of experts of width {moe.ffn_hidden_size} "
            "(n_shared_experts)"
        )
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "n_shared_experts": shared // moe.ffn_hidden_size,
        DENSE_LAYERS: leading_dense_count(moe.moe_layers, DENSE_LAYERS),
        **sigmoid_router_to_hf(moe),
    }


SHARED = f"{HF_MOE}.shared_experts"
LAYER = (*ATTENTION, QKV_BIAS, *QK_NORMS)
"""Attention (with the embedding, final norm and output layer): the q/k/v biases and q/k norms `require` their
feature, present where the config switches it on."""
MOE = (
    *ROUTED,
    expert_score_bias(f"{HF_MOE}.gate.e_score_correction_bias"),
    *shared_experts(f"{SHARED}.gate_proj.weight", f"{SHARED}.up_proj.weight", f"{SHARED}.down_proj.weight"),
)

ARCHITECTURE = Architecture(
    hf_name="Glm4MoeForCausalLM",
    model_type="glm4_moe",
    table=(*LAYER, *dense_only(DENSE_MLP), *MOE, *mtp_layer((*LAYER, *MOE))),
    qkv_bias="attention_bias",  # q, k and v only: `o_proj` never has a bias
    qk_norm="use_qk_norm",
    # what transformers' Glm4MoeConfig gives a config.json that lacks these fields
    hf_absent={
        "partial_rotary_factor": 0.5,
        "attention_bias": False,
        "use_qk_norm": False,
        DENSE_LAYERS: 1,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": True,
    },
    hf_size_fields={Size.EXPERTS: "n_routed_experts", Size.SHARED_FFN: "n_shared_experts * moe_intermediate_size"},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    score_function="sigmoid",
    mtp_copies=MTP_COPIES,
    fused_experts=FUSED_EXPERTS,
    tiny={
        "num_hidden_layers": 4,
        DENSE_LAYERS: 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "routed_scaling_factor": 2.5,
        "n_shared_experts": 2,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
        "attention_bias": True,
        "use_qk_norm": True,
        "head_dim": 16,
        "partial_rotary_factor": 0.5,
        "num_nextn_predict_layers": 0,
        "rope_theta": 1000000.0,
    },
)
