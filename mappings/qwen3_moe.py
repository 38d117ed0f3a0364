"""Qwen3-MoE (`Qwen3MoeForCausalLM`): Qwen3 attention (q/k norms), routed experts, optional dense layers; the
routing weights are rounded to the activation dtype before they scale the experts' outputs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import ATTENTION, DENSE_MLP, HF_LAYER
from hf_mcore_bridge.mappings.qwen3 import QK_NORMS
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import require
from hf_mcore_bridge.models.moe import MoeSpec, layer_pattern_to_hf, moe_layer_pattern, topk
from hf_mcore_bridge.models.moe_tables import dense_only, routed_experts

HF_MOE = f"{HF_LAYER}.mlp"


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """Softmax over the experts, top-k, renormalised where `norm_topk_prob` (absent: not); MoE layers by
    `decoder_sparse_step` and `mlp_only_layers`."""
    # the Hub's configs say num_experts; transformers 5 saves the same field as num_local_experts
    experts = config.get("num_experts") or require(config, "num_local_experts")
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=require(config, "moe_intermediate_size"),
        topk=topk(config, experts),
        moe_layers=moe_layer_pattern(config, num_layers),
        renormalize=bool(config.get("norm_topk_prob", False)),
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    return {
        "num_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "norm_topk_prob": moe.renormalize,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        **layer_pattern_to_hf(moe.moe_layers),
    }


FUSED_EXPERTS = {
    f"{HF_MOE}.experts.{{expert}}.gate_proj.weight": (f"{HF_MOE}.experts.gate_up_proj", "gate"),
    f"{HF_MOE}.experts.{{expert}}.up_proj.weight": (f"{HF_MOE}.experts.gate_up_proj", "up"),
    f"{HF_MOE}.experts.{{expert}}.down_proj.weight": (f"{HF_MOE}.experts.down_proj", "all"),
}
"""transformers 5 holds experts fused as `[num_experts, ...]` tensors; checkpoints saved that way are read too."""

ROUTED = routed_experts(
    norm=f"{HF_LAYER}.post_attention_layernorm.weight",
    router=f"{HF_MOE}.gate.weight",
    gate=f"{HF_MOE}.experts.{{expert}}.gate_proj.weight",
    up=f"{HF_MOE}.experts.{{expert}}.up_proj.weight",
    down=f"{HF_MOE}.experts.{{expert}}.down_proj.weight",
)

ARCHITECTURE = Architecture(
    hf_name="Qwen3MoeForCausalLM",
    model_type="qwen3_moe",
    table=(*ATTENTION, *QK_NORMS, *dense_only(DENSE_MLP), *ROUTED),
    qk_norm=True,
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    sliding_window_switch="use_sliding_window",
    hf_defaults={"use_sliding_window": False},
    hf_absent={"router_aux_loss_coef": 0.001},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    round_routing_weights=True,
    fused_experts=FUSED_EXPERTS,
    tiny={
        "num_hidden_layers": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "mlp_only_layers": [1],
        "norm_topk_prob": True,
        "head_dim": 16,
        "rope_theta": 1000000.0,
    },
)
