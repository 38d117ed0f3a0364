"""GLM-4.7-Flash (`Glm4MoeLiteForCausalLM`, `glm4_moe_lite`): DeepSeek-V3's multi-latent attention with GLM-4.5's
mixture of experts.

transformers composes it from the two: `DeepseekV3Attention` (the low-rank query, the key/value latent with its
shared rotary key, interleaved RoPE pairs where `rope_interleave`), GLM-4.5's sigmoid router with its expert score
bias and group-limited top-k, its shared expert `n_shared_experts` experts wide, its RMSNorms. The checkpoint's
tensor names are DeepSeek-V3's, so the table is DeepSeek-V3's (`mappings.deepseek_v3`), multi-token-prediction
layers (`num_nextn_predict_layers`, HF layers numbered after the decoder's) included.

What differs from both, read as transformers' model runs it:
- The MoE layers are those `mlp_layer_types` marks `sparse` (absent: every layer but the first); transformers'
  model never reads `first_k_dense_replace`, which published configs also carry: one that disagrees with the
  layer types is refused rather than silently ignored.
- The latent norms' epsilon is 1e-6 whatever `rms_norm_eps` says (`latent_norm_eps`). GLM-4.7-Flash's own
  `rms_norm_eps` is 1e-5: the project's megatron-core models build the latent norms at 1e-6 (`megatron.latent_norm`;
  Megatron-LM's own layer spec would use 1e-5, which conversion notes), and the engine runs them as transformers.
- transformers' config class gives absent fields GLM-4.7-Flash's values (`hf_absent`): routed scaling 1.8, one
  shared expert, no groups, `rms_norm_eps` 1e-5, the published latent sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hf_mcore_bridge.mappings.deepseek_v3 import (
    EMBEDDING,
    FINAL_NORM,
    HF_SIZE_FIELDS,
    LATENT_NORM_EPS,
    MLA,
    MOE,
    OUTPUT,
)
from hf_mcore_bridge.mappings.llama import DENSE_MLP
from hf_mcore_bridge.mappings.qwen3_moe import FUSED_EXPERTS
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.config_errors import ConfigError, require
from hf_mcore_bridge.models.moe import MoeSpec, sigmoid_router, sigmoid_router_to_hf, topk
from hf_mcore_bridge.models.moe_tables import MTP_COPIES, dense_only, mtp_layer

HF_NAME = "Glm4MoeLiteForCausalLM"
LAYER_TYPES = "mlp_layer_types"
DENSE_LAYERS = "first_k_dense_replace"
DENSE, SPARSE = "dense", "sparse"


def mlp_layer_pattern(config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Which layers are MoE: `mlp_layer_types` (`dense` / `sparse` per layer; absent: the first layer dense, as
    transformers' config class fills it in). A `first_k_dense_replace` that places them otherwise is refused:
    transformers' model ignores it, so the checkpoint and the model it names would disagree."""
    kinds = _layer_kinds(config, num_layers)
    pattern = tuple(kind == SPARSE for kind in kinds)
    if not any(pattern):
        raise ConfigError(f"config field {LAYER_TYPES} has no 'sparse' layer; a mixture of experts needs one")
    dense = config.get(DENSE_LAYERS)
    if dense is not None and (
        not isinstance(dense, int) or isinstance(dense, bool) or pattern != tuple(i >= dense for i in range(num_layers))
    ):
        raise ConfigError(
            f"config field {DENSE_LAYERS}={dense!r} disagrees with {LAYER_TYPES} {kinds} "
            f"(transformers' {HF_NAME} reads only {LAYER_TYPES})"
        )
    return pattern


def _layer_kinds(config: Mapping[str, Any], num_layers: int) -> list[str]:
    listed = config.get(LAYER_TYPES)
    if listed is None:
        return [DENSE] + [SPARSE] * (num_layers - 1)
    if (
        not isinstance(listed, list | tuple)
        or len(listed) != num_layers
        or any(kind not in (DENSE, SPARSE) for kind in listed)
    ):
        raise ConfigError(
            f"config field {LAYER_TYPES}={listed!r} must list 'dense' or 'sparse' for each of the "
            f"num_hidden_layers={num_layers} layers"
        )
    return list(listed)


def moe_from_hf(config: Mapping[str, Any], num_layers: int) -> MoeSpec:
    """`n_routed_experts` experts of width `moe_intermediate_size`, the sigmoid router (`sigmoid_router`), one
    shared expert `n_shared_experts` times as wide, MoE where `mlp_layer_types` says `sparse`."""
    experts = require(config, "n_routed_experts")
    k = topk(config, experts)
    width = require(config, "moe_intermediate_size")
    shared = require(config, "n_shared_experts")
    if not isinstance(shared, int) or isinstance(shared, bool) or shared < 1:
        raise ConfigError(f"config field n_shared_experts={shared!r} is not supported (at least 1 shared expert)")
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=width,
        topk=k,
        moe_layers=mlp_layer_pattern(config, num_layers),
        aux_loss_coeff=0.0,  # aux-loss-free balancing (`noaux_tc`): the correction bias does it
        shared_expert_size=shared * width,
        **sigmoid_router(config, experts, k),
    )


def moe_to_hf(moe: MoeSpec) -> dict[str, Any]:
    """The layer types and GLM's expert and router fields; `first_k_dense_replace` too where the pattern is
    leading dense layers (published configs carry it, and other readers of this architecture use it)."""
    shared = moe.shared_expert_size or 0
    if shared % moe.ffn_hidden_size or not shared:
        raise ConfigError(
            f"a shared expert of width {shared} is not a whole number of experts of width {moe.ffn_hidden_size} "
            "(n_shared_experts)"
        )
    fields: dict[str, Any] = {
        "n_routed_experts": moe.num_experts,
        "num_experts_per_tok": moe.topk,
        "moe_intermediate_size": moe.ffn_hidden_size,
        "n_shared_experts": shared // moe.ffn_hidden_size,
        LAYER_TYPES: [SPARSE if moe_layer else DENSE for moe_layer in moe.moe_layers],
        **sigmoid_router_to_hf(moe),
    }
    if True in moe.moe_layers and moe.moe_layers == tuple(
        i >= moe.moe_layers.index(True) for i in range(len(moe.moe_layers))
    ):
        fields[DENSE_LAYERS] = moe.moe_layers.index(True)
    return fields


TABLE = (EMBEDDING, *MLA, *dense_only(DENSE_MLP), *MOE, *mtp_layer((*MLA, *MOE)), FINAL_NORM, OUTPUT)

ARCHITECTURE = Architecture(
    hf_name=HF_NAME,
    model_type="glm4_moe_lite",
    table=TABLE,
    qkv_bias="attention_bias",
    o_bias="attention_bias",
    hf_defaults={"attention_bias": False},
    # what transformers' Glm4MoeLiteConfig gives a config.json that lacks these fields
    hf_absent={
        "rms_norm_eps": 1e-5,
        "attention_bias": False,
        "q_lora_rank": 768,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "rope_interleave": True,
        "n_shared_experts": 1,
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1536,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
    },
    moe_from_hf=moe_from_hf,
    moe_to_hf=moe_to_hf,
    fused_experts=FUSED_EXPERTS,
    score_function="sigmoid",
    hf_size_fields=HF_SIZE_FIELDS,
    mtp_copies=MTP_COPIES,
    latent_norm_eps=LATENT_NORM_EPS,
    tiny={
        "rms_norm_eps": 1e-5,  # GLM-4.7-Flash's: the latent norms' 1e-6 differs (see above)
        "num_hidden_layers": 4,
        "num_key_value_heads": 8,
        "q_lora_rank": 32,
        "kv_lora_rank": 24,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 12,
        # a dense layer after a MoE one: the layer types, not a leading dense count, place them
        LAYER_TYPES: [DENSE, SPARSE, DENSE, SPARSE],
        "n_routed_experts": 8,
        "num_experts_per_tok": 4,
        "n_group": 4,
        "topk_group": 2,
        "moe_intermediate_size": 32,
        "n_shared_experts": 2,
        "routed_scaling_factor": 1.8,
        "norm_topk_prob": True,
        "num_nextn_predict_layers": 0,
        "rope_theta": 1000000.0,
        "rope_interleave": True,
    },
)
