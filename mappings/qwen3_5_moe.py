"""Qwen3.5 MoE (`Qwen3_5MoeForCausalLM`, `model_type` `qwen3_5_moe_text`): Qwen3.5's hybrid of Gated DeltaNet and
gated full attention (`mappings.qwen3_5`), every MLP a mixture of experts with Qwen2-MoE's sigmoid-gated shared
expert (`mappings.qwen2_moe`). Its router always renormalises the top-k weights (transformers'
`Qwen3_5MoeTopKRouter` has no `norm_topk_prob`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hf_mcore_bridge.mappings.llama import DENSE_MLP
from hf_mcore_bridge.mappings.qwen2_moe import SHARED_EXPERT, moe_to_hf
from hf_mcore_bridge.mappings.qwen2_moe import moe_from_hf as qwen2_moe_from_hf
from hf_mcore_bridge.mappings.qwen3_5 import GATED_ATTENTION, GATED_DELTA_NET, HYBRID, TINY_HYBRID
from hf_mcore_bridge.mappings.qwen3_5 import WRAPPER as QWEN3_5_WRAPPER
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS, ROUTED
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.moe import MoeSpec
from hf_mcore_bridge.models.moe_tables import dense_only


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """Qwen2-MoE's experts and gated shared expert, the top-k weights renormalised."""
    return replace(qwen2_moe_from_hf(config, num_layers), renormalize=True)


TINY_MOE = {
    **TINY_HYBRID,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 48,
}

ARCHITECTURE = Architecture(
    hf_name="Qwen3_5MoeForCausalLM",
    model_type="qwen3_5_moe_text",
    table=(*GATED_ATTENTION, *GATED_DELTA_NET, *dense_only(DENSE_MLP), *ROUTED, *SHARED_EXPERT),
    **{**HYBRID, "hf_absent": {**HYBRID["hf_absent"], "router_aux_loss_coef": 0.001}},  # type: ignore[arg-type]
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    round_routing_weights=True,
    fused_experts=FUSED_EXPERTS,
    tiny=TINY_MOE,
)

WRAPPER = replace(QWEN3_5_WRAPPER, hf_name="Qwen3_5MoeForConditionalGeneration", model_type="qwen3_5_moe")
"""The Qwen3.5 MoE releases, laid out as Qwen3.5's (`mappings.qwen3_5.WRAPPER`)."""
