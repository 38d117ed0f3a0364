"""Table entries and config helpers shared by the mixture-of-experts architectures in `mappings/`.

Softmax routers (Mixtral, Qwen-MoE) need only `routed_experts` and a layer pattern. The sigmoid router with an
expert score bias and group-limited top-k (GLM-4.5, DeepSeek-V3) is `sigmoid_router` (HF config -> `MoeConfig`,
with its refusals) and `sigmoid_router_to_hf`, its bias entry `expert_score_bias`, an ungated shared expert
`shared_experts`, and leading dense layers (`first_k_dense_replace`) `leading_dense_layers` / `leading_dense_count`.
Their multi-token-prediction layers (HF's layers after the decoder's, megatron-core's `mtp.layers.{i}`) are
`mtp_layer`, with `MTP_COPIES`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.convert.config_errors import ConfigError, refuse_unless, require
from hf_mcore_bridge.convert.mapping_types import Direct, Entry, FusedGateUp, LayerKind, Size
from hf_mcore_bridge.convert.parallel_style import Parallel

if TYPE_CHECKING:
    from hf_mcore_bridge.convert.config_bridge import MoeConfig

MC_LAYER = "decoder.layers.{layer}"
MC_EXPERT = "decoder.layers.{layer}.mlp.experts.local_experts.{expert}"


def dense_only(entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """The same entries, present only on dense-MLP layers."""
    return tuple(replace(e, layers=LayerKind.DENSE) for e in entries)


def routed_experts(norm: str, router: str, gate: str, up: str, down: str) -> tuple[Entry, ...]:
    """Pre-MLP norm, router and routed experts of a MoE layer, from their HF name templates."""
    moe = LayerKind.MOE
    return (
        Direct(f"{MC_LAYER}.pre_mlp_layernorm.weight", norm, Parallel.REPLICATED, (Size.HIDDEN,), layers=moe),
        Direct(f"{MC_LAYER}.mlp.router.weight", router, Parallel.REPLICATED, (Size.EXPERTS, Size.HIDDEN), layers=moe),
        FusedGateUp(f"{MC_EXPERT}.linear_fc1.weight", gate=gate, up=up, width=Size.EXPERT_FFN, layers=moe),
        Direct(f"{MC_EXPERT}.linear_fc2.weight", down, Parallel.ROW, (Size.HIDDEN, Size.EXPERT_FFN), layers=moe),
    )


def moe_layer_pattern(config: Mapping[str, Any], num_layers: int) -> tuple[bool, ...]:
    """Qwen-MoE layer placement: MoE unless in `mlp_only_layers`, every `decoder_sparse_step`-th layer."""
    step = config.get("decoder_sparse_step", 1) or 1
    dense = set(config.get("mlp_only_layers") or [])
    return tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers))


def layer_pattern_to_hf(moe_layers: tuple[bool, ...]) -> dict[str, Any]:
    """The simplest `decoder_sparse_step` / `mlp_only_layers` pair that reproduces a layer pattern."""
    count = len(moe_layers)
    for step in range(1, count + 1):
        if moe_layer_pattern({"decoder_sparse_step": step}, count) == moe_layers:
            return {"decoder_sparse_step": step, "mlp_only_layers": []}
    return {"decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(moe_layers) if not moe]}


def topk(config: Mapping[str, Any], experts: int) -> int:
    k = require(config, "num_experts_per_tok")
    if not 0 < k <= experts:
        raise ConfigError(f"config field num_experts_per_tok={k} must be between 1 and the {experts} experts")
    return k


def expert_score_bias(hf: str) -> Direct:
    """The router's per-expert score bias of a MoE layer: HF `mlp.gate.e_score_correction_bias` [experts],
    megatron-core's `mlp.router.expert_bias` (a persistent buffer, saved in its sharded state dict). Both sides
    hold it in float32; it is added to the sigmoid scores only to choose the experts (`sigmoid_router`)."""
    return Direct(
        f"{MC_LAYER}.mlp.router.expert_bias",
        hf,
        Parallel.REPLICATED,
        (Size.EXPERTS,),
        layers=LayerKind.MOE,
        float32=True,
    )


def shared_experts(gate: str, up: str, down: str) -> tuple[Entry, ...]:
    """An ungated shared expert of a MoE layer, added to the routed experts' output (megatron-core's
    `mlp.shared_experts` with `moe_shared_expert_gate=False`), from its HF gate/up/down name templates."""
    moe = LayerKind.MOE
    return (
        FusedGateUp(
            f"{MC_LAYER}.mlp.shared_experts.linear_fc1.weight", gate=gate, up=up, width=Size.SHARED_FFN, layers=moe
        ),
        Direct(
            f"{MC_LAYER}.mlp.shared_experts.linear_fc2.weight",
            down,
            Parallel.ROW,
            (Size.HIDDEN, Size.SHARED_FFN),
            layers=moe,
        ),
    )


def leading_dense_layers(config: Mapping[str, Any], num_layers: int, field: str) -> tuple[bool, ...]:
    """DeepSeek/GLM layer placement: the first `config[field]` layers (`first_k_dense_replace`) dense, the rest
    MoE (megatron-core's `moe_layer_freq` as a list). At least one layer must be MoE."""
    dense = require(config, field)
    if not isinstance(dense, int) or isinstance(dense, bool) or not 0 <= dense < num_layers:
        raise ConfigError(
            f"config field {field}={dense!r} must be between 0 and num_hidden_layers - 1 = {num_layers - 1}"
        )
    return tuple(i >= dense for i in range(num_layers))


def leading_dense_count(moe_layers: tuple[bool, ...], field: str) -> int:
    """The `first_k_dense_replace` that reproduces a layer pattern; an error naming `field` if the pattern is not
    dense layers followed by MoE layers."""
    count = moe_layers.index(True) if True in moe_layers else len(moe_layers)
    if moe_layers != leading_dense_layers({field: count}, len(moe_layers), field):
        raise ConfigError(f"the MoE layer pattern {[int(m) for m in moe_layers]} cannot be written as {field}")
    return count


HF_GROUP_SCORE_TOPK = 2
"""transformers' group score in group-limited routing (DeepSeek-V3, GLM-4.5): the sum of each group's 2 largest
biased scores. megatron-core sums the largest `topk // group_topk`: the same where that is 2."""


def sigmoid_router(config: Mapping[str, Any], num_experts: int, topk: int) -> dict[str, Any]:
    """`MoeConfig` fields of transformers' sigmoid router with expert score bias (DeepSeek-V3's `noaux_tc`,
    GLM-4.5): scores s = sigmoid(logits) in float32; experts chosen by top-k of s + bias within the `topk_group`
    best of `n_group` groups; weights s of the chosen, divided by their sum (+1e-20) when `norm_topk_prob`, times
    `routed_scaling_factor`. megatron-core's `topk_routing_with_score_function` computes the same except where
    refused here by name: it renormalises exactly when top-k > 1 (so `norm_topk_prob` must say the same), and its
    group score sums the top `topk // topk_group` scores where transformers sums the top 2. Groups that do not
    restrict anything (`n_group` 1, or `topk_group == n_group`) are mapped to no groups."""
    refuse_unless(config, "scoring_func", "sigmoid")
    refuse_unless(config, "topk_method", "noaux_tc")
    normalise = require(config, "norm_topk_prob")
    if bool(normalise) != (topk > 1):
        raise ConfigError(
            f"config field norm_topk_prob={normalise!r} cannot be represented in megatron-core: with sigmoid scores "
            f"it renormalises the top-k weights exactly when num_experts_per_tok > 1 (here {topk})"
        )
    groups, chosen = config.get("n_group") or 1, config.get("topk_group") or 1
    if num_experts % groups:
        raise ConfigError(f"config field n_group={groups} does not divide the {num_experts} routed experts")
    if not 1 <= chosen <= groups:
        raise ConfigError(f"config field topk_group={chosen} must be between 1 and n_group={groups}")
    per_group = num_experts // groups
    restricted = chosen < groups
    if restricted and per_group < HF_GROUP_SCORE_TOPK:
        raise ConfigError(f"config field n_group={groups} leaves {per_group} expert per group; the group score needs 2")
    if restricted and topk // chosen != HF_GROUP_SCORE_TOPK:
        raise ConfigError(
            f"config fields num_experts_per_tok={topk}, topk_group={chosen} cannot be represented in megatron-core: "
            f"it ranks groups by their top {topk // chosen} scores (num_experts_per_tok // topk_group), transformers "
            f"by their top {HF_GROUP_SCORE_TOPK}"
        )
    if restricted and topk > chosen * per_group:
        raise ConfigError(
            f"config field num_experts_per_tok={topk} exceeds the {chosen * per_group} experts of topk_group={chosen} "
            f"groups of {per_group}"
        )
    scale = config.get("routed_scaling_factor")
    scale = 1.0 if scale is None else float(scale)
    if scale <= 0:
        raise ConfigError(f"config field routed_scaling_factor={scale:g} must be positive")
    return {
        "score_function": "sigmoid",
        "pre_softmax": False,
        "expert_bias": True,
        "topk_scaling_factor": None if scale == 1.0 else scale,
        "num_groups": groups if restricted else None,
        "group_topk": chosen if restricted else None,
        "router_fp32": True,
    }


def sigmoid_router_to_hf(moe: MoeConfig) -> dict[str, Any]:
    """The HF config fields of a `sigmoid_router` (the inverse; a softmax router or one without expert bias is
    refused: transformers' sigmoid router always has both)."""
    if moe.score_function != "sigmoid" or not moe.expert_bias:
        raise ConfigError(
            f"a {moe.score_function} router {'with' if moe.expert_bias else 'without'} expert bias cannot be written "
            "as a sigmoid router with e_score_correction_bias"
        )
    return {
        "n_group": moe.num_groups or 1,
        "topk_group": moe.group_topk or 1,
        "routed_scaling_factor": moe.topk_scaling_factor or 1.0,
        "norm_topk_prob": moe.topk > 1,
    }


HF_LAYER = "model.layers.{layer}"
MC_MTP = "mtp.layers.{layer}"


def mtp_layer(decoder: tuple[Entry, ...]) -> tuple[Entry, ...]:
    """A multi-token-prediction layer (DeepSeek-V3, GLM-4.5; `{layer}` is its HF layer index in HF names and its
    MTP index in megatron-core names): the norms of the next token's embedding and of the hidden state, their
    projection `eh_proj` (over `[embedding; hidden]` in both), a decoder layer made of `decoder`'s layer entries
    (megatron-core's `transformer_layer`), and the norm before the shared output layer."""
    mtp = LayerKind.MTP

    def inside(entry: Entry) -> Entry:
        return replace(entry, mcore=entry.mcore.replace(f"{MC_LAYER}.", f"{MC_MTP}.transformer_layer."), layers=mtp)

    norm, replicated = (Size.HIDDEN,), Parallel.REPLICATED
    return (
        Direct(f"{MC_MTP}.enorm.weight", f"{HF_LAYER}.enorm.weight", replicated, norm, layers=mtp),
        Direct(f"{MC_MTP}.hnorm.weight", f"{HF_LAYER}.hnorm.weight", replicated, norm, layers=mtp),
        Direct(
            f"{MC_MTP}.eh_proj.weight",
            f"{HF_LAYER}.eh_proj.weight",
            Parallel.COLUMN,
            (Size.HIDDEN, Size.TWO_HIDDEN),
            layers=mtp,
        ),
        *(inside(e) for e in decoder if e.mcore.startswith(f"{MC_LAYER}.")),
        Direct(f"{MC_MTP}.final_layernorm.weight", f"{HF_LAYER}.shared_head.norm.weight", replicated, norm, layers=mtp),
    )


MTP_COPIES = {
    f"{HF_LAYER}.embed_tokens.weight": "model.embed_tokens.weight",
    f"{HF_LAYER}.shared_head.head.weight": "lm_head.weight",
}
"""An MTP layer's own copies of the embedding and output layer, which megatron-core's MTP shares with the model
(`Architecture.mtp_copies`)."""
