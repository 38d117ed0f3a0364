"""Qwen2-MoE (`Qwen2MoeForCausalLM`): Qwen2 attention (q/k/v biases, switched by `qkv_bias`, on where absent),
routed experts as Qwen3-MoE's, and a shared expert scaled by a sigmoid gate."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hf_mcore_bridge.mappings.llama import ATTENTION, DENSE_MLP, MC_LAYER
from hf_mcore_bridge.mappings.qwen2 import QKV_BIAS
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS, HF_MOE, ROUTED
from hf_mcore_bridge.mappings.qwen3_moe import moe_from_hf as qwen3_moe_from_hf
from hf_mcore_bridge.mappings.qwen3_moe import moe_to_hf as qwen3_moe_to_hf
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import require
from hf_mcore_bridge.models.mapping_types import Direct, FusedGateUp, LayerKind, Size
from hf_mcore_bridge.models.moe import MoeSpec
from hf_mcore_bridge.models.moe_tables import dense_only
from hf_mcore_bridge.models.parallel_style import Parallel


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """Qwen2-MoE's shared expert is always gated: sigmoid(x . w_gate) * shared_expert(x)."""
    routed = qwen3_moe_from_hf(config, num_layers)
    return replace(
        routed, shared_expert_size=require(config, "shared_expert_intermediate_size"), shared_expert_gate=True
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    return {**qwen3_moe_to_hf(moe), "shared_expert_intermediate_size": moe.shared_expert_size}


SHARED = f"{HF_MOE}.shared_expert"
SHARED_EXPERT = (
    FusedGateUp(
        f"{MC_LAYER}.mlp.shared_experts.linear_fc1.weight",
        gate=f"{SHARED}.gate_proj.weight",
        up=f"{SHARED}.up_proj.weight",
        width=Size.SHARED_FFN,
        layers=LayerKind.MOE,
    ),
    Direct(
        f"{MC_LAYER}.mlp.shared_experts.linear_fc2.weight",
        f"{SHARED}.down_proj.weight",
        Parallel.ROW,
        (Size.HIDDEN, Size.SHARED_FFN),
        layers=LayerKind.MOE,
    ),
    Direct(
        f"{MC_LAYER}.mlp.shared_experts.gate_weight",
        f"{HF_MOE}.shared_expert_gate.weight",
        Parallel.REPLICATED,
        (Size.ONE, Size.HIDDEN),
        layers=LayerKind.MOE,
    ),
)

ARCHITECTURE = Architecture(
    hf_name="Qwen2MoeForCausalLM",
    model_type="qwen2_moe",
    table=(*ATTENTION, QKV_BIAS, *dense_only(DENSE_MLP), *ROUTED, *SHARED_EXPERT),
    qkv_bias="qkv_bias",
    sliding_window_switch="use_sliding_window",
    hf_defaults={"use_sliding_window": False},
    hf_absent={"qkv_bias": True, "router_aux_loss_coef": 0.001},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    round_routing_weights=True,
    fused_experts=FUSED_EXPERTS,
    tiny={
        "num_hidden_layers": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "norm_topk_prob": False,
        "rope_theta": 1000000.0,
    },
)
