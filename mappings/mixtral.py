"""Mixtral (`MixtralForCausalLM`): Llama attention, every layer a routed MoE (softmax -> top-k -> renormalise)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import ATTENTION, HF_LAYER
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import require
from hf_mcore_bridge.models.moe import MoeSpec, topk
from hf_mcore_bridge.models.moe_tables import routed_experts

HF_MOE = f"{HF_LAYER}.block_sparse_moe"


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """Mixtral's router always renormalises the top-k softmax weights; its experts' width is `intermediate_size`."""
    experts = require(config, "num_local_experts")
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=require(config, "intermediate_size"),
        topk=topk(config, experts),
        moe_layers=(True,) * num_layers,
        renormalize=True,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        jitter_noise=float(config.get("router_jitter_noise") or 0.0),
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    return {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "intermediate_size": moe.ffn_hidden_size,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "router_jitter_noise": moe.jitter_noise,
    }


ARCHITECTURE = Architecture(
    hf_name="MixtralForCausalLM",
    model_type="mixtral",
    table=(
        *ATTENTION,
        *routed_experts(
            norm=f"{HF_LAYER}.post_attention_layernorm.weight",
            router=f"{HF_MOE}.gate.weight",
            gate=f"{HF_MOE}.experts.{{expert}}.w1.weight",
            up=f"{HF_MOE}.experts.{{expert}}.w3.weight",
            down=f"{HF_MOE}.experts.{{expert}}.w2.weight",
        ),
    ),
    hf_defaults={"sliding_window": None},
    hf_absent={"router_aux_loss_coef": 0.001},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    fused_experts={
        f"{HF_MOE}.experts.{{expert}}.w1.weight": (f"{HF_LAYER}.mlp.experts.gate_up_proj", "gate"),
        f"{HF_MOE}.experts.{{expert}}.w3.weight": (f"{HF_LAYER}.mlp.experts.gate_up_proj", "up"),
        f"{HF_MOE}.experts.{{expert}}.w2.weight": (f"{HF_LAYER}.mlp.experts.down_proj", "all"),
        f"{HF_MOE}.gate.weight": (f"{HF_LAYER}.mlp.gate.weight", "all"),
    },
    tiny={
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "sliding_window": None,
        "rope_theta": 1000000.0,
    },
)
