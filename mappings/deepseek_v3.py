"""DeepSeek-V3 / V3.1 / R1, Kimi-K2 and Moonlight (`DeepseekV3ForCausalLM`): multi-latent attention, a sigmoid
router with an expert-score correction bias and group-limited top-k, shared experts, dense first layers.

Multi-latent attention (`spec.MlaSpec`) maps onto megatron-core's MLA: the query's down/up projections
(or Moonlight's single `q_proj`), the key/value down-projection with the shared rotary key, their RMSNorms (fused
into the up-projections under Transformer Engine's names) and the key/value up-projection, whose rows are laid out
per head as `[k_nope; v]` in both. The router is megatron-core's sigmoid `TopKRouter` with `expert_bias`.

Multi-token-prediction layers (`num_nextn_predict_layers`, HF layers numbered after the decoder's) map onto
megatron-core's MTP (`mtp.layers.{i}`: `enorm`, `hnorm`, `eh_proj`, a MoE decoder layer, `final_layernorm`); their
copies of the embedding and output layer, which megatron-core shares, must equal the model's (`convert.mtp`).

transformers' model hard-codes what some config fields seem to choose: the latent norms' epsilon is 1e-6 whatever
`rms_norm_eps` says (`latent_norm_eps`; the project's megatron-core models build them so, `megatron.latent_norm`,
where Megatron-LM's own layer spec would use `rms_norm_eps`: conversion notes a difference), the router is sigmoid
`noaux_tc` (`sigmoid_router` refuses another `scoring_func` or `topk_method`), and the MoE layers are those from
`first_k_dense_replace` on (another `moe_layer_freq` is refused). Kimi-K2 is this architecture (`model_type`
`kimi_k2`, which transformers reads as `deepseek_v3`); its published config uses no field this path refuses,
Kimi-K2.5's language model one (int4 experts; its `rms_norm_eps: 1e-5` converts with the note:
`tests/convert/test_kimi.py`). `attention_bias` would bias `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`: neither
conversion nor the engine has them. The correction bias is float32 on both sides (`expert_score_bias`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.llama import ATTENTION as LLAMA_ATTENTION
from hf_mcore_bridge.mappings.llama import DENSE_MLP, HF_LAYER, MC_LAYER
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS, HF_MOE
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import ConfigError, refuse_unless, require
from hf_mcore_bridge.models.mapping_types import Direct, Feature, RotaryRows, Size
from hf_mcore_bridge.models.moe import (
    MoeSpec,
    leading_dense_count,
    leading_dense_layers,
    sigmoid_router,
    sigmoid_router_to_hf,
    topk,
)
from hf_mcore_bridge.models.moe_tables import (
    MTP_COPIES,
    dense_only,
    expert_score_bias,
    mtp_layer,
    routed_experts,
    shared_experts,
)
from hf_mcore_bridge.models.parallel_style import Parallel

HF_ATTN = f"{HF_LAYER}.self_attn"
MC_ATTN = f"{MC_LAYER}.self_attention"
COLUMN, ROW, REPLICATED = Parallel.COLUMN, Parallel.ROW, Parallel.REPLICATED
Q_LORA, FULL_RANK_Q = Feature.Q_LORA, Feature.FULL_RANK_Q

EMBEDDING, FINAL_NORM, OUTPUT = LLAMA_ATTENTION[0], LLAMA_ATTENTION[-2], LLAMA_ATTENTION[-1]

MLA = (
    Direct(f"{MC_LAYER}.input_layernorm.weight", f"{HF_LAYER}.input_layernorm.weight", REPLICATED, (Size.HIDDEN,)),
    Direct(
        f"{MC_ATTN}.linear_q_down_proj.weight",
        f"{HF_ATTN}.q_a_proj.weight",
        COLUMN,
        (Size.Q_LORA, Size.HIDDEN),
        requires=Q_LORA,
    ),
    Direct(
        f"{MC_ATTN}.linear_q_up_proj.layer_norm_weight",
        f"{HF_ATTN}.q_a_layernorm.weight",
        REPLICATED,
        (Size.Q_LORA,),
        requires=Q_LORA,
    ),
    RotaryRows(
        f"{MC_ATTN}.linear_q_up_proj.weight",
        f"{HF_ATTN}.q_b_proj.weight",
        (Size.MLA_Q, Size.Q_LORA),
        per_head=True,
        requires=Q_LORA,
    ),
    RotaryRows(
        f"{MC_ATTN}.linear_q_proj.weight",
        f"{HF_ATTN}.q_proj.weight",
        (Size.MLA_Q, Size.HIDDEN),
        per_head=True,
        requires=FULL_RANK_Q,
    ),
    RotaryRows(
        f"{MC_ATTN}.linear_kv_down_proj.weight",
        f"{HF_ATTN}.kv_a_proj_with_mqa.weight",
        (Size.KV_DOWN, Size.HIDDEN),
        per_head=False,
    ),
    Direct(
        f"{MC_ATTN}.linear_kv_up_proj.layer_norm_weight",
        f"{HF_ATTN}.kv_a_layernorm.weight",
        REPLICATED,
        (Size.KV_LORA,),
    ),
    Direct(f"{MC_ATTN}.linear_kv_up_proj.weight", f"{HF_ATTN}.kv_b_proj.weight", COLUMN, (Size.KV_UP, Size.KV_LORA)),
    Direct(f"{MC_ATTN}.linear_proj.weight", f"{HF_ATTN}.o_proj.weight", ROW, (Size.HIDDEN, Size.MLA_V)),
)
"""A decoder layer's input norm and multi-latent attention (Transformer Engine's names: the latents' norms are
the up-projections' `layer_norm_weight`; the down-projections are column-parallel in the local spec)."""

SHARED = f"{HF_MOE}.shared_experts"
MOE = (
    *routed_experts(
        norm=f"{HF_LAYER}.post_attention_layernorm.weight",
        router=f"{HF_MOE}.gate.weight",
        gate=f"{HF_MOE}.experts.{{expert}}.gate_proj.weight",
        up=f"{HF_MOE}.experts.{{expert}}.up_proj.weight",
        down=f"{HF_MOE}.experts.{{expert}}.down_proj.weight",
    ),
    expert_score_bias(f"{HF_MOE}.gate.e_score_correction_bias"),
    *shared_experts(f"{SHARED}.gate_proj.weight", f"{SHARED}.up_proj.weight", f"{SHARED}.down_proj.weight"),
)
"""Pre-MLP norm, sigmoid router and its correction bias, routed experts and the (ungated) shared experts."""

MLA_HF_FIELDS = {
    Size.MLA_Q: "num_attention_heads * (qk_nope_head_dim + qk_rope_head_dim)",
    Size.Q_LORA: "q_lora_rank",
    Size.KV_LORA: "kv_lora_rank",
    Size.KV_DOWN: "kv_lora_rank + qk_rope_head_dim",
    Size.KV_UP: "num_attention_heads * (qk_nope_head_dim + v_head_dim)",
    Size.MLA_V: "num_attention_heads * v_head_dim",
}
"""The HF config fields of the multi-latent attention's dimensions (named in shape errors)."""
HF_SIZE_FIELDS = MLA_HF_FIELDS | {
    Size.EXPERTS: "n_routed_experts",
    Size.SHARED_FFN: "n_shared_experts * moe_intermediate_size",
}
"""Those and the experts' (DeepSeek-V3's names, also GLM-4.7-Flash's)."""

TABLE = (EMBEDDING, *MLA, *dense_only(DENSE_MLP), *MOE, *mtp_layer((*MLA, *MOE)), FINAL_NORM, OUTPUT)


LATENT_NORM_EPS = 1e-6
"""The epsilon of HF's `q_a_layernorm` / `kv_a_layernorm`, whatever `rms_norm_eps` says."""


DENSE_LAYERS = "first_k_dense_replace"


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """`n_routed_experts` experts of width `moe_intermediate_size`, the sigmoid router (`sigmoid_router`),
    `n_shared_experts` shared experts fused into one MLP (none: no shared expert), and `first_k_dense_replace`
    dense layers first (the only placement transformers' model has: `moe_layer_freq` must be 1)."""
    refuse_unless(config, "moe_layer_freq", 1)
    experts = require(config, "n_routed_experts")
    k = topk(config, experts)
    width = require(config, "moe_intermediate_size")
    shared = config.get("n_shared_experts") or 0
    if not isinstance(shared, int) or shared < 0:
        raise ConfigError(f"config field n_shared_experts={shared!r} must be a non-negative integer")
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=width,
        topk=k,
        moe_layers=leading_dense_layers({DENSE_LAYERS: 0, **config}, num_layers, DENSE_LAYERS),
        aux_loss_coeff=0.0,  # aux-loss-free balancing (`noaux_tc`): the correction bias does it
        shared_expert_size=width * shared if shared else None,
        **sigmoid_router({"norm_topk_prob": True, **config}, experts, k),
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    shared = (moe.shared_expert_size or 0) // moe.ffn_hidden_size
    if shared * moe.ffn_hidden_size != (moe.shared_expert_size or 0):
        raise ConfigError(f"shared expert width {moe.shared_expert_size} is no multiple of {moe.ffn_hidden_size}")
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "n_shared_experts": shared,
        DENSE_LAYERS: leading_dense_count(moe.moe_layers, DENSE_LAYERS),
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        **sigmoid_router_to_hf(moe),
    }


ARCHITECTURE = Architecture(
    hf_name="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    table=TABLE,
    other_model_types=("kimi_k2",),  # Kimi-K2's config.json (and Kimi-K2.5's text_config) names this type
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    hf_defaults={"attention_bias": False},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    fused_experts=FUSED_EXPERTS,
    score_function="sigmoid",
    hf_size_fields=HF_SIZE_FIELDS,
    mtp_copies=MTP_COPIES,
    latent_norm_eps=LATENT_NORM_EPS,
    tiny={
        "rms_norm_eps": LATENT_NORM_EPS,
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
    },
)
