"""The mixture-of-experts part of a model, and the HF config readers its architectures share.

Softmax routers (Mixtral, Qwen-MoE) need a layer pattern (`moe_layer_pattern` / `layer_pattern_to_hf`) and `topk`.
The sigmoid router with an expert score bias and group-limited top-k (GLM-4.5, DeepSeek-V3) is `sigmoid_router`
(HF config -> `MoeSpec` fields) and `sigmoid_router_to_hf`; leading dense layers
(`first_k_dense_replace`) are `leading_dense_layers` / `leading_dense_count`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.models.config_errors import ConfigError, refuse_unless, require


@dataclass(frozen=True)
class MoeSpec:
    """The mixture of experts of a model, as its HF config describes it (`Architecture.moe_from_hf`)."""

    num_experts: int
    """Routed experts per MoE layer."""
    ffn_hidden_size: int
    """FFN width of one routed expert."""
    topk: int
    """Experts each token is routed to (`num_experts_per_tok`)."""
    moe_layers: tuple[bool, ...]
    """Per decoder layer: a routed MoE (True) or a dense MLP (False)."""
    renormalize: bool
    """The chosen experts' weights are divided by their sum (HF `norm_topk_prob`; Mixtral always): for a softmax
    router, softmax -> top-k -> renormalise; otherwise the chosen experts keep their scores."""
    aux_loss_coeff: float
    """HF `router_aux_loss_coef`: recorded in a checkpoint's `args` and written back on export, never turned into
    a training loss here (`transformer_config_kwargs` sets megatron-core's `moe_aux_loss_coeff` to 0)."""
    shared_expert_size: int | None = None
    """FFN width of the shared expert (Qwen2-MoE; GLM-4.5's `n_shared_experts` experts fused into one), if any."""
    shared_expert_gate: bool = False
    """Whether the shared expert's output is scaled by a sigmoid gate (Qwen2-MoE); otherwise it is added as it is."""
    score_function: str = "softmax"
    """The router's score of each expert: `softmax` over the experts, or an independent `sigmoid` per expert
    (DeepSeek-V3, GLM-4.5; megatron-core's `moe_router_score_function`)."""
    expert_bias: bool = False
    """A per-expert bias added to the scores for choosing the experts only, not to their weights (HF
    `e_score_correction_bias`, held in float32; megatron-core's `moe_router_enable_expert_bias`)."""
    topk_scaling_factor: float | None = None
    """The chosen experts' weights are multiplied by this (HF `routed_scaling_factor`); None: 1."""
    num_groups: int | None = None
    """Group-limited routing: the experts are cut into this many groups (HF `n_group`); None: no groups (also
    where the groups restrict nothing)."""
    group_topk: int | None = None
    """Group-limited routing: the groups each token may use (HF `topk_group`), ranked by the sum of their
    `HF_GROUP_SCORE_TOPK` largest biased scores."""
    router_fp32: bool = False
    """The router's logits are computed in float32 from float32 copies of its input and weight, whatever the
    model's dtype (HF GLM-4.5 and DeepSeek-V3; megatron-core's `moe_router_dtype='fp32'`)."""
    jitter_noise: float = 0.0
    """HF `router_jitter_noise` (Mixtral): multiplicative noise on the router's input, in training only."""
    expert_mlp_bias: bool = False
    """Each routed expert's gate/up and down projections have a bias (GPT-OSS's `gate_up_proj_bias` [E, 2F] and
    `down_proj_bias` [E, H]), added before the activation and before the routing weight respectively
    (megatron-core: `add_bias_linear`)."""
    swiglu_limit: float | None = None
    """The experts' clamped gated activation (GPT-OSS's `swiglu_limit`): (clamp(up, -l, l) + 1) * g *
    sigmoid(`swiglu_alpha` * g) with g = min(gate, l); None: silu(gate) * up (megatron-core: `quick_gelu` with
    `activation_func_clamp_value` l and `glu_linear_offset` 1)."""
    swiglu_alpha: float = 1.702
    """The sigmoid's slope in the clamped activation (GPT-OSS's `swiglu_alpha`); unused without `swiglu_limit`."""

    router_bias: bool = False
    """The router's logits have a bias (GPT-OSS's `mlp.router.bias` [E]); megatron-core's router has one exactly
    with `add_bias_linear`."""

    @property
    def pre_softmax(self) -> bool:
        """A softmax router that does not renormalise (megatron-core's `moe_router_pre_softmax`: softmax over all
        experts, then top-k; otherwise top-k of the logits then softmax over the k, which renormalises)."""
        return self.score_function == "softmax" and not self.renormalize


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
    """`MoeSpec` fields of transformers' sigmoid router with expert score bias (DeepSeek-V3's `noaux_tc`,
    GLM-4.5): scores s = sigmoid(logits) in float32; experts chosen by top-k of s + bias within the `topk_group`
    best of `n_group` groups (ranked by the sum of their 2 largest biased scores); weights s of the chosen, divided
    by their sum (+1e-20) when `norm_topk_prob`, times `routed_scaling_factor`. Groups that do not restrict anything
    (`n_group` 1, or `topk_group == n_group`) are read as no groups. Refused: another `scoring_func` or
    `topk_method` (transformers' model computes this router whatever they say), and groups transformers cannot
    rank (fewer than 2 experts each)."""
    refuse_unless(config, "scoring_func", "sigmoid")
    refuse_unless(config, "topk_method", "noaux_tc")
    normalise = require(config, "norm_topk_prob")
    groups, chosen = config.get("n_group") or 1, config.get("topk_group") or 1
    if num_experts % groups:
        raise ConfigError(f"config field n_group={groups} does not divide the {num_experts} routed experts")
    if not 1 <= chosen <= groups:
        raise ConfigError(f"config field topk_group={chosen} must be between 1 and n_group={groups}")
    per_group = num_experts // groups
    restricted = chosen < groups
    if restricted and per_group < HF_GROUP_SCORE_TOPK:
        raise ConfigError(f"config field n_group={groups} leaves {per_group} expert per group; the group score needs 2")
    scale = config.get("routed_scaling_factor")
    scale = 1.0 if scale is None else float(scale)
    if scale <= 0:
        raise ConfigError(f"config field routed_scaling_factor={scale:g} must be positive")
    return {
        "score_function": "sigmoid",
        "renormalize": bool(normalise),
        "expert_bias": True,
        "topk_scaling_factor": None if scale == 1.0 else scale,
        "num_groups": groups if restricted else None,
        "group_topk": chosen if restricted else None,
        "router_fp32": True,
    }


def sigmoid_router_to_hf(moe: MoeSpec) -> dict[str, Any]:
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
        "norm_topk_prob": moe.renormalize,
    }
