"""Qwen3-Next (`Qwen3NextForCausalLM`, `model_type` `qwen3_next`): Qwen3.5 MoE's hybrid decoder
(`mappings.qwen3_5_moe`) with Gated DeltaNet's input projection fused per key head (`in_proj_qkvz`, `in_proj_ba`;
`GroupedLinearInProj`), and routed experts by Qwen3-MoE's config fields (`norm_topk_prob`, `decoder_sparse_step`,
`mlp_only_layers`) beside Qwen2-MoE's sigmoid-gated shared expert."""

from __future__ import annotations

from hf_mcore_bridge.mappings.llama import DENSE_MLP
from hf_mcore_bridge.mappings.qwen2_moe import SHARED_EXPERT, moe_from_hf, moe_to_hf
from hf_mcore_bridge.mappings.qwen3_5 import (
    GATED_ATTENTION,
    GATED_DELTA_NET_TAIL,
    GDN,
    HYBRID,
    LINEAR,
    LINEAR_INPUT_NORM,
)
from hf_mcore_bridge.mappings.qwen3_5_moe import TINY_MOE
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS, ROUTED
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import LINEAR_ATTENTION, GroupedLinearInProj
from hf_mcore_bridge.models.moe_tables import dense_only

FUSED_GATED_DELTA_NET = (
    LINEAR_INPUT_NORM,
    GroupedLinearInProj(
        f"{GDN}.in_proj.weight",
        qkvz=f"{LINEAR}.in_proj_qkvz.weight",
        ba=f"{LINEAR}.in_proj_ba.weight",
        attention=LINEAR_ATTENTION,
    ),
    *GATED_DELTA_NET_TAIL,
)

ARCHITECTURE = Architecture(
    hf_name="Qwen3NextForCausalLM",
    model_type="qwen3_next",
    table=(*GATED_ATTENTION, *FUSED_GATED_DELTA_NET, *dense_only(DENSE_MLP), *ROUTED, *SHARED_EXPERT),
    **{  # type: ignore[arg-type]
        **HYBRID,
        "hf_absent": {**HYBRID["hf_absent"], "norm_topk_prob": True, "router_aux_loss_coef": 0.001},
    },
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    round_routing_weights=True,
    fused_experts=FUSED_EXPERTS,
    tiny={**TINY_MOE, "norm_topk_prob": True, "mlp_only_layers": [2]},  # a dense layer: a heterogeneous MLP pattern
)
