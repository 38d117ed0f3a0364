"""GPT-OSS (`GptOssForCausalLM`, gpt-oss-20b / gpt-oss-120b): Llama attention with biases on q/k/v and o, a
learnable sink logit per head (`self_attn.sinks`), sliding-window and full layers as `layer_types` lists them,
YaRN; every layer a mixture of biased experts behind a biased top-k-then-softmax router, with the clamped SwiGLU
(`swiglu_limit`, `swiglu_alpha`).

The checkpoint stores each layer's experts fused, as transformers holds them (`fused_checkpoint`):
`gate_up_proj` [E, H, 2F] with gate and up interleaved along the last axis, `gate_up_proj_bias` [E, 2F],
`down_proj` [E, F, H] (transposed against a linear layer's weight) and `down_proj_bias` [E, H]. The table names
each expert's tensors as linear layers (`{expert}.gate_proj.weight` [F, H], ...), cut from the fused tensors by
`FUSED_EXPERTS` (`checkpoint.expert_parts`) on import and written back fused on export.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import ATTENTION, HF_LAYER, MC_LAYER
from hf_mcore_bridge.mappings.qwen2 import QKV_BIAS
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import ConfigError, require
from hf_mcore_bridge.models.mapping_types import Direct, Feature, FusedGateUp, LayerKind, Size
from hf_mcore_bridge.models.moe import MoeSpec, topk
from hf_mcore_bridge.models.moe_tables import MC_EXPERT, routed_experts
from hf_mcore_bridge.models.parallel_style import Parallel

HF_MOE = f"{HF_LAYER}.mlp"
HF_EXPERT = f"{HF_MOE}.experts.{{expert}}"
HF_FUSED = f"{HF_MOE}.experts"


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """`num_local_experts` experts of width `intermediate_size` in every layer; top-k of the biased router's logits,
    softmax over the k (megatron-core's default routing); biased experts with the clamped SwiGLU."""
    experts = config.get("num_local_experts") or require(config, "num_experts")
    if not config.get("layer_types"):  # transformers alternates sliding and full layers by its own default then
        raise ConfigError("config field layer_types is missing (GPT-OSS's sliding and full layers are read from it)")
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=require(config, "intermediate_size"),
        topk=topk(config, experts),
        moe_layers=(True,) * num_layers,
        renormalize=True,
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.0)),
        expert_mlp_bias=True,
        router_bias=True,
        swiglu_limit=float(require(config, "swiglu_limit")),
        swiglu_alpha=float(require(config, "swiglu_alpha")),
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    return {
        "num_local_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "router_aux_loss_coef": moe.aux_loss_coeff,
        "swiglu_limit": moe.swiglu_limit,
        "swiglu_alpha": moe.swiglu_alpha,
    }


FUSED_EXPERTS = {
    f"{HF_EXPERT}.gate_proj.weight": (f"{HF_FUSED}.gate_up_proj", "even_t"),
    f"{HF_EXPERT}.up_proj.weight": (f"{HF_FUSED}.gate_up_proj", "odd_t"),
    f"{HF_EXPERT}.gate_proj.bias": (f"{HF_FUSED}.gate_up_proj_bias", "even_t"),
    f"{HF_EXPERT}.up_proj.bias": (f"{HF_FUSED}.gate_up_proj_bias", "odd_t"),
    f"{HF_EXPERT}.down_proj.weight": (f"{HF_FUSED}.down_proj", "t"),
    f"{HF_EXPERT}.down_proj.bias": (f"{HF_FUSED}.down_proj_bias", "all"),
}

moe = LayerKind.MOE
ATTENTION_EXTRAS = (
    QKV_BIAS,
    Direct(
        f"{MC_LAYER}.self_attention.linear_proj.bias",
        f"{HF_LAYER}.self_attn.o_proj.bias",
        Parallel.REPLICATED,  # a row-parallel layer's bias is added once, after the reduction
        (Size.HIDDEN,),
        requires=Feature.O_BIAS,
    ),
    Direct(
        f"{MC_LAYER}.self_attention.core_attention.softmax_offset",
        f"{HF_LAYER}.self_attn.sinks",
        Parallel.COLUMN,  # one per query head, split with the heads
        (Size.HEADS,),
    ),
)
EXPERTS = (
    *routed_experts(
        norm=f"{HF_LAYER}.post_attention_layernorm.weight",
        router=f"{HF_MOE}.router.weight",
        gate=f"{HF_EXPERT}.gate_proj.weight",
        up=f"{HF_EXPERT}.up_proj.weight",
        down=f"{HF_EXPERT}.down_proj.weight",
    ),
    Direct(f"{MC_LAYER}.mlp.router.bias", f"{HF_MOE}.router.bias", Parallel.REPLICATED, (Size.EXPERTS,), layers=moe),
    FusedGateUp(
        f"{MC_EXPERT}.linear_fc1.bias",
        gate=f"{HF_EXPERT}.gate_proj.bias",
        up=f"{HF_EXPERT}.up_proj.bias",
        width=Size.EXPERT_FFN,
        layers=moe,
        bias=True,
    ),
    Direct(
        f"{MC_EXPERT}.linear_fc2.bias", f"{HF_EXPERT}.down_proj.bias", Parallel.REPLICATED, (Size.HIDDEN,), layers=moe
    ),
)

ARCHITECTURE = Architecture(
    hf_name="GptOssForCausalLM",
    model_type="gpt_oss",
    table=(*ATTENTION, *ATTENTION_EXTRAS, *EXPERTS),
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    attention_sinks=True,
    hf_absent={"attention_bias": True, "swiglu_limit": 7.0, "swiglu_alpha": 1.702, "router_aux_loss_coef": 0.001},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    fused_experts=FUSED_EXPERTS,
    fused_checkpoint=True,
    round_routing_weights=True,  # transformers' softmax over the top k runs in the activations' dtype
    tiny={
        "num_hidden_layers": 4,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "intermediate_size": 32,
        "head_dim": 16,
        "sliding_window": 6,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "swiglu_limit": 1.5,  # low enough that random weights reach the clamp
        "rope_theta": 150000.0,
        "max_position_embeddings": 131072,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    },
)
