"""DeepSeek-V3 / V3.1 / R1, Kimi-K2 and Moonlight (`DeepseekV3ForCausalLM`): multi-latent attention, a sigmoid
router with an expert-score correction bias and group-limited top-k, shared experts, dense first layers.

Multi-latent attention maps onto megatron-core's MLA (`config_bridge.MlaConfig`): the query's down/up projections
(or Moonlight's single `q_proj`), the key/value down-projection with the shared rotary key, their RMSNorms (fused
into the up-projections under Transformer Engine's names) and the key/value up-projection, whose rows are laid out
per head as `[k_nope; v]` in both. The router is megatron-core's sigmoid `TopKRouter` with `expert_bias`.

Multi-token-prediction layers (`num_nextn_predict_layers`, HF layers numbered after the decoder's) map onto
megatron-core's MTP (`mtp.layers.{i}`: `enorm`, `hnorm`, `eh_proj`, a MoE decoder layer, `final_layernorm`); their
copies of the embedding and output layer, which megatron-core shares, must equal the model's (`convert.mtp`).

Refused, because megatron-core computes something else: groups ranked other than by their top-2 scores
(megatron-core sums the top `topk // topk_group`), unnormalised sigmoid weights of several experts (megatron-core
renormalises them) or a renormalised single one, `topk_method` other than `noaux_tc`, `scoring_func` other than
`sigmoid`, MoE layers placed other than after the first `first_k_dense_replace` (`moe_layer_freq` other than 1),
and `rms_norm_eps` other than 1e-6 (HF's latent norms use 1e-6 whatever it says, megatron-core's use it). The
router and its correction bias keep the dtype they are stored in (HF keeps them in float32).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hf_mcore_bridge.convert.architecture import Architecture
from hf_mcore_bridge.convert.config_bridge import MoeConfig
from hf_mcore_bridge.convert.config_errors import ConfigError, refuse_unless, require
from hf_mcore_bridge.convert.mapping_types import Direct, Entry, FusedGateUp, LayerKind, Requires, RotaryRows, Size
from hf_mcore_bridge.convert.moe_tables import dense_only, routed_experts, topk
from hf_mcore_bridge.convert.parallel_style import Parallel
from hf_mcore_bridge.mappings.llama import ATTENTION as LLAMA_ATTENTION
from hf_mcore_bridge.mappings.llama import DENSE_MLP, HF_LAYER, MC_LAYER
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS, HF_MOE

HF_ATTN = f"{HF_LAYER}.self_attn"
MC_ATTN = f"{MC_LAYER}.self_attention"
COLUMN, ROW, REPLICATED = Parallel.COLUMN, Parallel.ROW, Parallel.REPLICATED
Q_LORA, FULL_RANK_Q = Requires.Q_LORA, Requires.FULL_RANK_Q

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
    Direct(
        f"{MC_LAYER}.mlp.router.expert_bias",
        f"{HF_MOE}.gate.e_score_correction_bias",
        REPLICATED,
        (Size.EXPERTS,),
        layers=LayerKind.MOE,
    ),
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
        ROW,
        (Size.HIDDEN, Size.SHARED_FFN),
        layers=LayerKind.MOE,
    ),
)
"""Pre-MLP norm, sigmoid router and its correction bias, routed experts and the (ungated) shared experts."""

MC_MTP = "mtp.layers.{layer}"


def _in_mtp(entry: Entry) -> Entry:
    """A decoder layer's entry as the transformer layer of a multi-token-prediction layer."""
    mcore = entry.mcore.replace(f"{MC_LAYER}.", f"{MC_MTP}.transformer_layer.")
    return replace(entry, mcore=mcore, layers=LayerKind.MTP)


MTP = (
    Direct(f"{MC_MTP}.enorm.weight", f"{HF_LAYER}.enorm.weight", REPLICATED, (Size.HIDDEN,), layers=LayerKind.MTP),
    Direct(f"{MC_MTP}.hnorm.weight", f"{HF_LAYER}.hnorm.weight", REPLICATED, (Size.HIDDEN,), layers=LayerKind.MTP),
    Direct(
        f"{MC_MTP}.eh_proj.weight",
        f"{HF_LAYER}.eh_proj.weight",
        COLUMN,
        (Size.HIDDEN, Size.TWO_HIDDEN),
        layers=LayerKind.MTP,
    ),
    *(_in_mtp(e) for e in (*MLA, *MOE)),
    Direct(
        f"{MC_MTP}.final_layernorm.weight",
        f"{HF_LAYER}.shared_head.norm.weight",
        REPLICATED,
        (Size.HIDDEN,),
        layers=LayerKind.MTP,
    ),
)
"""A multi-token-prediction layer (HF's layers after the decoder's; megatron-core's `mtp.layers.{i}`): the norms
of the next token's embedding and of the hidden state, their projection `eh_proj` (over `[embedding; hidden]` in
both), a MoE decoder layer, and the norm before the shared output layer."""

MTP_COPIES = {
    f"{HF_LAYER}.embed_tokens.weight": "model.embed_tokens.weight",
    f"{HF_LAYER}.shared_head.head.weight": "lm_head.weight",
}
"""The MTP layer's copies of the embedding and output layer, which megatron-core's MTP shares with the model."""

TABLE = (EMBEDDING, *MLA, *dense_only(DENSE_MLP), *MOE, *MTP, FINAL_NORM, OUTPUT)


LATENT_NORM_EPS = 1e-6
"""The epsilon of HF's `q_a_layernorm` / `kv_a_layernorm`, whatever `rms_norm_eps` says (megatron-core gives its
latent norms `rms_norm_eps`)."""


def check(config: Mapping[str, Any]) -> None:
    """What HF's DeepSeek-V3 model hard-codes: sigmoid scores, `noaux_tc` top-k, MoE from layer
    `first_k_dense_replace` on, and latent norms of epsilon 1e-6."""
    refuse_unless(config, "topk_method", "noaux_tc")
    refuse_unless(config, "scoring_func", "sigmoid")
    refuse_unless(config, "moe_layer_freq", 1)
    eps = config.get("rms_norm_eps")
    if eps is not None and float(eps) != LATENT_NORM_EPS:
        raise ConfigError(
            f"config field rms_norm_eps={eps!r} cannot be represented in megatron-core's MLA: HF's q_a_layernorm "
            f"and kv_a_layernorm use {LATENT_NORM_EPS:g} whatever rms_norm_eps, megatron-core uses rms_norm_eps"
        )


def _groups(config: Mapping[str, Any], experts: int, k: int) -> tuple[int | None, int | None]:
    """megatron-core's (num_groups, group_topk), or (None, None) where the group limit picks every expert."""
    groups, chosen = config.get("n_group") or 1, config.get("topk_group") or 1
    if chosen >= groups:
        return None, None
    if experts % groups or experts // groups < 2:
        raise ConfigError(f"config field n_group={groups} must split the {experts} experts into groups of 2 or more")
    if k // chosen != 2:
        raise ConfigError(
            f"config fields num_experts_per_tok={k}, topk_group={chosen} cannot be represented in megatron-core: "
            f"it ranks groups by their top {k // chosen} scores, HF by their top 2"
        )
    return groups, chosen


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeConfig:
    """Sigmoid scores plus `e_score_correction_bias` choose the experts; the chosen scores, renormalised, times
    `routed_scaling_factor` weight them (megatron-core's sigmoid router with expert bias does the same)."""
    experts = require(config, "n_routed_experts")
    k = topk(config, experts)
    if bool(config.get("norm_topk_prob", True)) != (k > 1):
        raise ConfigError(
            f"config field norm_topk_prob={config.get('norm_topk_prob', True)!r} with num_experts_per_tok={k} cannot "
            "be represented in megatron-core (it renormalises sigmoid scores exactly when more than one expert is "
            "chosen)"
        )
    width = require(config, "moe_intermediate_size")
    shared = config.get("n_shared_experts") or 0
    dense = config.get("first_k_dense_replace") or 0
    groups, chosen = _groups(config, experts, k)
    return MoeConfig(
        num_experts=experts,
        ffn_hidden_size=width,
        topk=k,
        moe_layers=tuple(i >= dense for i in range(num_layers)),
        pre_softmax=False,
        aux_loss_coeff=0.0,  # aux-loss-free balancing (`noaux_tc`): the correction bias does it
        shared_expert_size=width * shared if shared else None,
        score_function="sigmoid",
        expert_bias=True,
        topk_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        num_groups=groups,
        group_topk=chosen,
        router_dtype="fp32",  # HF keeps the gate and the correction bias in float32
    )


def moe_to_hf(moe: MoeConfig) -> dict[str, Any]:
    dense = moe.moe_layers.index(True) if True in moe.moe_layers else len(moe.moe_layers)
    if moe.moe_layers != tuple(i >= dense for i in range(len(moe.moe_layers))):
        raise ConfigError(f"MoE layer pattern {moe.moe_layers} is not DeepSeek-V3's (dense layers first)")
    shared = (moe.shared_expert_size or 0) // moe.ffn_hidden_size
    if shared * moe.ffn_hidden_size != (moe.shared_expert_size or 0):
        raise ConfigError(f"shared expert width {moe.shared_expert_size} is no multiple of {moe.ffn_hidden_size}")
    return {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "n_shared_experts": shared,
        "first_k_dense_replace": dense,
        "n_group": moe.num_groups or 1,
        "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.topk_scaling_factor or 1.0,
        "norm_topk_prob": moe.topk > 1,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


ARCHITECTURE = Architecture(
    hf_name="DeepseekV3ForCausalLM",
    model_type="deepseek_v3",
    table=TABLE,
    check=check,
    hf_defaults={"attention_bias": False},
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    fused_experts=FUSED_EXPERTS,
    mtp_copies=MTP_COPIES,
    own_dtype=(f"{HF_MOE}.gate.weight", f"{HF_MOE}.gate.e_score_correction_bias"),
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
