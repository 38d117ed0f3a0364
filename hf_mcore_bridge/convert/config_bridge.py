"""A model's description (`models.spec.ModelSpec`) <-> megatron-core's configuration, both directions.

From the spec come megatron-core's `TransformerConfig` arguments, the `GPTModel` arguments and a Megatron-LM
`args` namespace (so that `--use-checkpoint-args` rebuilds the model); from a checkpoint's `args` comes the spec
back (`from_megatron_args`), and from it an HF `config.json` (`ModelSpec.to_hf`).

Anything megatron-core cannot compute as transformers does is refused naming the HF config field, over the spec
(`require_megatron_representable`; `megatron_spec` reads a config and checks it); nothing is approximated. In
particular: RoPE must be plain, linear (megatron-core's `seq_len_interpolation_factor`), Llama-3 scaled with
megatron-core's hard-coded low/high frequency factors (1, 4) and original length 8192, or YaRN; the sliding layers'
own RoPE (Gemma 3) plain; no biases but q/k/v ones where the table has them, or every linear layer's (GPT-OSS:
`add_bias_linear`); SiLU, GPT-OSS's clamped SwiGLU (`quick_gelu` with `activation_func_clamp_value` and
`glu_linear_offset` 1), or Gemma's tanh-approximated GeGLU without experts; a sliding window only on the layers
`layer_types` marks (`window_size`,
`window_attn_skip_freq`); sinks as `softmax_type: learnable`. Partial rotary
embeddings (`partial_rotary_factor`, GLM-4.5) are megatron-core's `rotary_percent`: both rotate the first
`int(head_dim * factor)` dimensions of each head in the `rotate_half` layout and pass the rest through.

Multi-latent attention (a config with `kv_lora_rank`, DeepSeek-V2/V3 style) is a property of the config, not of
an architecture name: its dimensions go to megatron-core's `MLATransformerConfig`, with plain RoPE or DeepSeek's
YaRN (`rope_type: yarn` with `factor`, `original_max_position_embeddings`, `beta_fast`/`beta_slow`, `mscale` and
`mscale_all_dim`, which megatron-core's `YarnRotaryEmbedding` computes as HF does). YaRN options HF has and
megatron-core lacks (`attention_factor`, `truncate: false`, `mscale_all_dim` without `mscale`) are refused. The
latent norms, whose epsilon transformers fixes whatever `rms_norm_eps` says (`ModelSpec.latent_norm_eps`), are built
at that epsilon by the project's layer spec (`megatron.latent_norm`) where megatron-core's own would use
`rms_norm_eps`; conversion says so in a note (`latent_norm_note`).

Training-time behaviour that an HF config implies but that would change a trainer's objective is off here and
left to the trainer to switch on: the auxiliary load-balancing loss (`moe_aux_loss_coeff` 0) and the updates of
the router's expert bias (`moe_router_bias_update_rate` 0; GRPO: `policy.megatron_cfg.moe_router_bias_update_rate`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.megatron_lm_args import loader_defaults
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.transformer_impl import default_transformer_impl
from hf_mcore_bridge.models.config_errors import ConfigError
from hf_mcore_bridge.models.mapping_types import Feature
from hf_mcore_bridge.models.moe import HF_GROUP_SCORE_TOPK, MoeSpec
from hf_mcore_bridge.models.registry import with_features
from hf_mcore_bridge.models.spec import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    SLIDING_ATTENTION,
    LinearAttentionSpec,
    MlaSpec,
    ModelSpec,
    RopeSpec,
    switch_name,
    yarn_mscale,
)
from hf_mcore_bridge.models.tensor_ops import padded_vocab_size

MCORE_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""The Llama-3 RoPE scaling constants megatron-core hard-codes."""

MCORE_QUICK_GELU_ALPHA = 1.702
"""The sigmoid's slope in megatron-core's `quick_gelu` (hard-coded), GPT-OSS's `swiglu_alpha`."""

GATED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
"""The gated MLP activations megatron-core computes as transformers does (SwiGLU; GeGLU with the tanh
approximation, Gemma's)."""

PARAMS_DTYPES = (dtypes.FLOAT32, dtypes.BFLOAT16, dtypes.FLOAT16)
"""The dtypes a model's parameters are held in (`--dtype`'s choices, `dtypes.FLAGS`)."""


def params_dtype_name(dtype: Any) -> str | None:
    """The HF `torch_dtype` name of a parameter dtype (torch's or a `dtypes.DType`); None for any other value."""
    try:
        found = None if dtype is None else dtypes.of(dtype)
    except ValueError:
        return None
    return found.name if found in PARAMS_DTYPES else None


def megatron_spec(config: Any) -> ModelSpec:
    """The description of an HF config (`ModelSpec.from_hf`), refused unless megatron-core can represent it."""
    spec = ModelSpec.from_hf(config)
    require_megatron_representable(spec)
    return spec


def require_megatron_representable(spec: ModelSpec) -> None:
    """Refuse, naming the HF config field, what megatron-core's GPT model cannot compute as transformers does."""
    _require_layers(spec)
    _require_rope(spec)
    if spec.mla is not None:
        _require_mla(spec)
    if spec.moe is not None:
        _require_router(spec.moe)


def _unrepresentable(what: str, where: str = "megatron-core") -> ConfigError:
    return ConfigError(f"config field {what} cannot be represented in {where}")


def _require_layers(spec: ModelSpec) -> None:
    """A pre-norm decoder of SiLU-gated MLPs, without biases (q/k/v ones where the table has them) or with every
    linear layer's (`add_bias_linear`), attending to every earlier position or, on the layers `layer_types` marks
    `sliding_attention`, through the window (`window_size`, `window_attn_skip_freq`)."""
    arch = spec.arch
    if spec.hidden_act not in GATED_ACTIVATIONS or (spec.hidden_act != "silu" and spec.moe is not None):
        raise ConfigError(
            f"config field {arch.hidden_act_field}={spec.hidden_act!r} cannot be represented (only 'silu', and "
            "'gelu_pytorch_tanh' without experts)"
        )
    if spec.sliding_rope is not None and spec.sliding_rope.rope_type != "default":
        raise _unrepresentable(f"rope_parameters.sliding_attention.rope_type={spec.sliding_rope.rope_type!r}")
    if spec.o_bias or (spec.moe is not None and (spec.moe.expert_mlp_bias or spec.moe.router_bias)):
        _require_linear_biases(spec)
    if spec.qkv_bias and not arch.table_has(Feature.QKV_BIAS):
        raise _unrepresentable(f"{switch_name(arch.qkv_bias, 'attention_bias')}=True")
    if spec.mlp_bias:
        raise _unrepresentable("mlp_bias=True")
    kinds = set(spec.layer_types)
    known = {FULL_ATTENTION, SLIDING_ATTENTION} | ({LINEAR_ATTENTION} if spec.linear_attention else set())
    if kinds - known:
        raise ConfigError(f"config field layer_types has {sorted(kinds)}; only {sorted(known)} are known")
    if spec.sliding_window is not None and SLIDING_ATTENTION not in kinds:
        switch = arch.sliding_window_switch  # a window over every layer, no layer_types saying which
        raise _unrepresentable(f"{switch}=True" if switch else f"sliding_window={spec.sliding_window!r}")
    if spec.sliding_window is None and SLIDING_ATTENTION in kinds:
        raise ConfigError("config field layer_types has sliding_attention layers but no sliding_window")
    if spec.mtp_layers and spec.moe is not None and not spec.moe.moe_layers[-1]:
        # megatron-core's MTP layer is built as the last decoder layer; the tables' MTP layers are MoE
        raise ConfigError(
            f"config field num_nextn_predict_layers={spec.mtp_layers} cannot be represented in megatron-core with a "
            "dense last layer (its multi-token-prediction layers copy the last layer's kind; these are MoE)"
        )


def _require_linear_biases(spec: ModelSpec) -> None:
    """megatron-core biases the attention's output projection only with every linear layer's bias
    (`add_bias_linear`): q/k/v, router and experts, all in the table."""
    arch, moe = spec.arch, spec.moe
    complete = spec.qkv_bias and moe is not None and moe.expert_mlp_bias and moe.router_bias and all(moe.moe_layers)
    if not complete or not arch.table_has(Feature.O_BIAS):
        field = f"{switch_name(arch.o_bias, 'attention_bias')}=True" if spec.o_bias else "gate_up_proj_bias"
        raise _unrepresentable(f"{field} (megatron-core biases all linear layers or none)")


def _require_rope(spec: ModelSpec) -> None:
    """Plain RoPE, partial or not; linear scaling (Gemma 3's full layers); Llama-3 scaling with megatron-core's
    constants; YaRN (under multi-latent
    attention with its own limits; otherwise GPTModel's `position_embedding_type='yarn'`, whose attention
    multiplies q and k by the concentration of `yarn_config_attributes`, an explicit `attention_factor` made up
    in the softmax scale)."""
    rope, mla = spec.rope, spec.mla is not None
    if rope.rope_type == "default":
        return
    if rope.rope_type == "yarn" and mla:
        _require_yarn(rope)
        return
    if rope.rope_type == "yarn":  # GPTModel's YaRN; its concentration goes into the softmax scale
        if rope.original_max_position_embeddings is None:
            raise ConfigError("config field rope_type='yarn' needs rope_scaling.original_max_position_embeddings")
        return
    if rope.rope_type in ("llama3", "linear") and mla:
        raise _unrepresentable(f"rope_type={rope.rope_type!r}", "megatron-core's MLA")
    if rope.rope_type == "linear":  # GPTModel's `seq_len_interpolation_factor`: positions divided by the factor
        return
    if rope.rope_type != "llama3":
        raise _unrepresentable(f"rope_type={rope.rope_type!r}")
    for name, expected in MCORE_LLAMA3_ROPE.items():
        value = getattr(rope, name)
        if float(value) != expected:
            raise ConfigError(
                f"config field rope_scaling.{name}={value!r} cannot be represented in megatron-core "
                f"(it hard-codes {expected:g})"
            )


def _require_yarn(rope: RopeSpec) -> None:
    """megatron-core's YaRN computes HF's correction range (floor/ceil of the bounds), ramp and concentration
    mscale(factor, mscale) / mscale(factor, mscale_all_dim) (with mscale 1 where HF ignores it)."""
    if rope.original_max_position_embeddings is None:
        raise ConfigError("config field rope_scaling.original_max_position_embeddings is missing")
    if rope.attention_factor is not None:
        raise _unrepresentable("rope_scaling.attention_factor")
    if not rope.truncate:
        raise _unrepresentable("rope_scaling.truncate=false")
    if rope.mscale_all_dim and not rope.mscale:
        raise ConfigError(
            f"config field rope_scaling.mscale_all_dim={rope.mscale_all_dim!r} without mscale cannot be represented in "
            "megatron-core (which divides the concentration by mscale(factor, mscale_all_dim))"
        )


def _require_mla(spec: ModelSpec) -> None:
    """megatron-core's MLA rotates every rotary dim. (Its latent norms' epsilon, `rms_norm_eps` in megatron-core's
    own specs, is the project's layer spec's business: `latent_norm_note`.)"""
    if spec.rope.partial_rotary_factor != 1.0:
        raise _unrepresentable(f"partial_rotary_factor={spec.rope.partial_rotary_factor:g}", "megatron-core's MLA")


def latent_norm_note(spec: ModelSpec) -> str | None:
    """The one-line notice for a multi-latent model whose latent norms' epsilon is not `rms_norm_eps`: the
    project's megatron-core models build them at transformers' epsilon (`megatron.latent_norm`), Megatron-LM's own
    layer spec would not. None where the two agree."""
    if spec.mla is None or spec.latent_norm_eps == spec.norm_epsilon:
        return None
    return (
        f"the latent norms (q_a_layernorm, kv_a_layernorm) use epsilon {spec.latent_norm_eps:g} as transformers "
        f"does, not rms_norm_eps={spec.norm_epsilon:g}: this project's megatron-core models build them so; "
        "Megatron-LM's own layer spec would use rms_norm_eps for those two norms"
    )


def _require_router(moe: MoeSpec) -> None:
    """megatron-core's `topk_routing_with_score_function` computes transformers' routers except: sigmoid weights it
    renormalises exactly when top-k > 1; its group score sums the top `topk // topk_group` scores where transformers
    sums the top 2, over groups that must hold the top-k; no router input noise. Biased experts and routers come
    with every linear layer's bias (`_require_linear_biases`); the clamped activation is `quick_gelu`, whose slope
    megatron-core fixes at 1.702, on every MLP (so no dense layers beside it)."""
    if moe.jitter_noise:
        raise _unrepresentable(f"router_jitter_noise={moe.jitter_noise}")
    if (moe.expert_mlp_bias or moe.router_bias) and not all(moe.moe_layers):
        raise _unrepresentable("gate_up_proj_bias with dense layers (megatron-core would bias their MLPs too)")
    if moe.swiglu_limit is not None and moe.swiglu_alpha != MCORE_QUICK_GELU_ALPHA:
        raise _unrepresentable(f"swiglu_alpha={moe.swiglu_alpha:g} (quick_gelu's slope is {MCORE_QUICK_GELU_ALPHA})")
    if moe.swiglu_limit is not None and not all(moe.moe_layers):
        raise _unrepresentable(f"swiglu_limit={moe.swiglu_limit:g} with dense layers (their activation is SiLU)")
    if moe.score_function == "sigmoid" and moe.renormalize != (moe.topk > 1):
        raise ConfigError(
            f"config field norm_topk_prob={moe.renormalize!r} cannot be represented in megatron-core: with sigmoid "
            f"scores it renormalises the top-k weights exactly when num_experts_per_tok > 1 (here {moe.topk})"
        )
    if moe.num_groups is None or moe.group_topk is None:
        return
    topk, chosen = moe.topk, moe.group_topk
    if topk // chosen != HF_GROUP_SCORE_TOPK:
        raise ConfigError(
            f"config fields num_experts_per_tok={topk}, topk_group={chosen} cannot be represented in megatron-core: "
            f"it ranks groups by their top {topk // chosen} scores (num_experts_per_tok // topk_group), transformers "
            f"by their top {HF_GROUP_SCORE_TOPK}"
        )
    per_group = moe.num_experts // moe.num_groups
    if topk > chosen * per_group:
        raise ConfigError(
            f"config field num_experts_per_tok={topk} exceeds the {chosen * per_group} experts of topk_group={chosen} "
            f"groups of {per_group}"
        )


def _mla_kwargs(model: ModelSpec) -> dict[str, Any]:
    """`MLATransformerConfig` fields (`megatron.model.transformer_config` picks that class when they are set)."""
    mla, rope = model.mla, model.rope
    if mla is None:
        return {}
    yarn = rope.rope_type == "yarn"
    return {
        "multi_latent_attention": True,
        "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank,
        "qk_head_dim": mla.qk_nope_head_dim,
        "qk_pos_emb_head_dim": mla.qk_rope_head_dim,
        "v_head_dim": mla.v_head_dim,
        "qk_layernorm": True,  # the q and kv latents' RMSNorms (HF q_a_layernorm, kv_a_layernorm)
        "rope_type": "yarn" if yarn else "rope",
        "rotary_base": rope.theta,
        "rotary_percent": 1.0,
        "rotary_scaling_factor": rope.factor if yarn else 1.0,
        "original_max_position_embeddings": rope.original_max_position_embeddings if yarn else 4096,
        "beta_fast": rope.beta_fast if yarn else 32.0,
        "beta_slow": rope.beta_slow if yarn else 1.0,
        # megatron-core always divides mscale(factor, mscale) by mscale(factor, mscale_all_dim): mscale 1 and
        # mscale_all_dim 0 give transformers' mscale(factor) where it ignores `mscale`
        "mscale": (rope.mscale or 1.0) if yarn else 1.0,
        "mscale_all_dim": rope.mscale_all_dim if yarn else 0.0,
        "apply_rope_fusion": False,
    }


def _moe_kwargs(moe: MoeSpec | None, layout: Layout) -> dict[str, Any]:
    if moe is None:
        return {}
    return {
        "num_moe_experts": moe.num_experts,
        "moe_ffn_hidden_size": moe.ffn_hidden_size,
        "moe_router_topk": moe.topk,
        "moe_layer_freq": 1 if all(moe.moe_layers) else [int(m) for m in moe.moe_layers],
        "moe_router_pre_softmax": moe.pre_softmax,
        # HF configs carry a pre-training load-balancing coefficient (`router_aux_loss_coef`); turned into an
        # always-on loss it would change the objective of every run that builds this config. A trainer that wants
        # it sets `moe_aux_loss_coeff` itself (GRPO: policy.megatron_cfg.transformer.moe_aux_loss_coeff).
        "moe_aux_loss_coeff": 0.0,
        "moe_shared_expert_intermediate_size": moe.shared_expert_size,
        "moe_shared_expert_gate": moe.shared_expert_gate,
        "moe_router_score_function": moe.score_function,
        "moe_router_enable_expert_bias": moe.expert_bias,
        "moe_router_topk_scaling_factor": moe.topk_scaling_factor,
        "moe_router_num_groups": moe.num_groups,
        "moe_router_group_topk": moe.group_topk,
        "moe_router_dtype": "fp32" if moe.router_fp32 else None,
        # megatron-core moves the expert bias towards balanced loads after every optimizer step (default rate
        # 1e-3): a change to the model no loss asks for. A trainer that wants it sets the rate itself (GRPO:
        # policy.megatron_cfg.moe_router_bias_update_rate).
        "moe_router_bias_update_rate": 0.0,
        "moe_grouped_gemm": False,
        "moe_token_dispatcher_type": "allgather",
        "expert_tensor_parallel_size": layout.etp,
    }


def transformer_config_kwargs(model: ModelSpec, layout: Layout, dtype: Any) -> dict[str, Any]:
    """Keyword arguments for megatron-core's `TransformerConfig` (activation given as `torch.nn.functional.silu`;
    `transformer_impl` from `transformer_impl.default_transformer_impl`).

    MoE layers use the `allgather` token dispatcher, which also runs on CPU; override it for GPU training. The
    auxiliary load-balancing loss is off (`moe_aux_loss_coeff` 0, whatever the HF `router_aux_loss_coef`), and so
    are the expert-bias updates (`moe_router_bias_update_rate` 0). Multi-token-prediction layers are left out
    (`mtp_num_layers` unset): megatron-core's GPTModel then computes their loss on every forward and needs labels;
    `megatron.model.build_gpt_model(mtp=True)` builds them. `dtype`: torch's or a `dtypes.DType`.
    """
    import torch

    kind = dtypes.of(dtype)
    return (
        _moe_kwargs(model.moe, layout)
        | _mla_kwargs(model)
        | {
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "ffn_hidden_size": model.ffn_hidden_size,
            "num_attention_heads": model.num_attention_heads,
            "num_query_groups": model.num_query_groups,
            "kv_channels": model.head_dim,
            "normalization": "RMSNorm",
            "layernorm_epsilon": model.norm_epsilon,
            "gated_linear_unit": True,
            "activation_func": torch.nn.functional.silu if model.hidden_act == "silu" else gelu_tanh,
            "layernorm_zero_centered_gamma": model.norm_offset,
            "add_bias_linear": model.o_bias,
            "add_qkv_bias": model.qkv_bias,
            "qk_layernorm": model.qk_norm or model.mla is not None,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tensor_model_parallel_size": layout.tp,
            "pipeline_model_parallel_size": layout.pp,
            "virtual_pipeline_model_parallel_size": layout.vpp,
            "context_parallel_size": layout.cp,
            "expert_model_parallel_size": layout.ep,
            "num_layers_in_first_pipeline_stage": layout.first_stage_layers,
            "num_layers_in_last_pipeline_stage": layout.last_stage_layers,
            "params_dtype": kind.torch,
            "pipeline_dtype": kind.torch,
            "bf16": kind == dtypes.BFLOAT16,
            "fp16": kind == dtypes.FLOAT16,
            "transformer_impl": default_transformer_impl(),
        }
        | _attention_kwargs(model)
        | _activation_kwargs(model.moe)
        | linear_attention_kwargs(model)
    )


def linear_attention_kwargs(model: ModelSpec) -> dict[str, Any]:
    """megatron-core's Gated DeltaNet (`experimental_attention_variant`, a per-layer `linear_attention_freq`, its
    dimensions) and the full-attention layers' output gate; nothing for a model without them."""
    kwargs: dict[str, Any] = {"attention_output_gate": True} if model.attention_output_gate else {}
    linear = model.linear_attention
    if linear is None:
        return kwargs
    return kwargs | {
        "experimental_attention_variant": "gated_delta_net",
        "linear_attention_freq": [int(kind == LINEAR_ATTENTION) for kind in model.layer_types],
        "linear_conv_kernel_dim": linear.conv_kernel,
        "linear_key_head_dim": linear.key_head_dim,
        "linear_value_head_dim": linear.value_head_dim,
        "linear_num_key_heads": linear.num_key_heads,
        "linear_num_value_heads": linear.num_value_heads,
    }


def _linear_attention_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`ModelSpec` fields from `linear_attention_kwargs`' arguments (nothing where they are absent)."""
    fields: dict[str, Any] = {"attention_output_gate": bool(getattr(args, "attention_output_gate", False))}
    if getattr(args, "experimental_attention_variant", None) != "gated_delta_net":
        return fields
    pattern = getattr(args, "linear_attention_freq", None)
    if not isinstance(pattern, list):
        raise ConfigError(f"checkpoint args linear_attention_freq={pattern!r}: only a per-layer list is read")
    linear = LinearAttentionSpec(
        num_key_heads=args.linear_num_key_heads,
        num_value_heads=args.linear_num_value_heads,
        key_head_dim=args.linear_key_head_dim,
        value_head_dim=args.linear_value_head_dim,
        conv_kernel=args.linear_conv_kernel_dim,
    )
    kinds = tuple(LINEAR_ATTENTION if on else FULL_ATTENTION for on in pattern)
    return fields | {"linear_attention": linear, "layer_types": kinds}


def _attention_kwargs(model: ModelSpec) -> dict[str, Any]:
    """Sinks (`softmax_type`), the sliding window on the layers `layer_types` marks (megatron-core's window keeps
    `window_size[0]` earlier positions besides the query's own: transformers' window counts the query's), and
    the softmax scale where transformers' YaRN concentration is not megatron-core's (not under multi-latent
    attention)."""
    kwargs: dict[str, Any] = {}
    if model.query_pre_attn_scalar is not None:
        kwargs["softmax_scale"] = model.softmax_scale
    if model.attention_sinks:
        kwargs["softmax_type"] = "learnable"
    if model.sliding_window is not None:
        kwargs["window_size"] = (model.sliding_window - 1, 0)
        kwargs["window_attn_skip_freq"] = [int(kind == SLIDING_ATTENTION) for kind in model.layer_types]
    rope = model.rope
    if rope.rope_type == "yarn" and model.mla is None:
        # megatron-core multiplies q and k by its concentration (`_yarn_get_concentration_factor_from_config`);
        # where transformers' differs (an explicit `attention_factor`), the softmax scale makes up the ratio squared
        ratio = rope.attention_scaling / _mcore_yarn_concentration(rope)
        if ratio != 1.0:
            kwargs["softmax_scale"] = model.softmax_scale * ratio**2
    return kwargs


def _mcore_yarn_concentration(rope: RopeSpec) -> float:
    """megatron-core's YaRN concentration for `yarn_config_attributes`' mscale values."""
    return yarn_mscale(rope.factor, rope.mscale or 1.0) / yarn_mscale(rope.factor, rope.mscale_all_dim)


def gelu_tanh(x: Any) -> Any:
    """GeLU with the tanh approximation (transformers' `gelu_pytorch_tanh`): megatron-core's gated MLP activation
    for Gemma."""
    import torch

    return torch.nn.functional.gelu(x, approximate="tanh")


def _activation_kwargs(moe: MoeSpec | None) -> dict[str, Any]:
    """The clamped SwiGLU as megatron-core's `quick_gelu(min(gate, l)) * (clamp(up, -l, l) + 1)`."""
    if moe is None or moe.swiglu_limit is None:
        return {}
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    return {
        "activation_func": quick_gelu,
        "activation_func_clamp_value": moe.swiglu_limit,
        "glu_linear_offset": 1.0,
        "bias_activation_fusion": False,
    }


def yarn_config_attributes(model: ModelSpec) -> dict[str, Any]:
    """The attributes GPTModel's YaRN reads from its `TransformerConfig` by `getattr` (not fields of it: set after
    it is made); {} without YaRN or under multi-latent attention, whose config has its own fields."""
    rope = model.rope
    if rope.rope_type != "yarn" or model.mla is not None:
        return {}
    return {
        "yarn_rotary_scaling_factor": rope.factor,
        "yarn_original_max_position_embeddings": rope.original_max_position_embeddings,
        "yarn_beta_fast": rope.beta_fast,
        "yarn_beta_slow": rope.beta_slow,
        "yarn_mscale": rope.mscale or 1.0,  # mscale 1, all_dim 0: transformers' mscale(factor)
        "yarn_mscale_all_dim": rope.mscale_all_dim,
        "yarn_correction_range_round_to_int": rope.truncate,
    }


def gpt_model_kwargs(model: ModelSpec, padded_vocab: int) -> dict[str, Any]:
    """Keyword arguments for megatron-core's `GPTModel` besides the config and the layer spec."""
    return {
        "vocab_size": padded_vocab,
        "max_sequence_length": model.max_position_embeddings,
        "position_embedding_type": "yarn" if model.rope.rope_type == "yarn" and model.mla is None else "rope",
        "rotary_percent": model.rope.partial_rotary_factor,
        "rotary_base": model.rope.theta,
        "rope_scaling": _llama3(model.rope),
        "rope_scaling_factor": model.rope.factor if _llama3(model.rope) else 8.0,
        "seq_len_interpolation_factor": _linear_factor(model.rope),
        "share_embeddings_and_output_weights": model.tie_word_embeddings,
    }


def padded_vocab(model: ModelSpec, layout: Layout, divisible_by: int = 128) -> int:
    """The vocabulary Megatron-LM would pad to for this layout."""
    return padded_vocab_size(model.vocab_size, divisible_by, layout.tp)


def megatron_args(
    model: ModelSpec,
    layout: Layout,
    dtype: Any,
    *,
    make_vocab_size_divisible_by: int = 128,
    spec: str = "te",
    ckpt_format: str = "torch_dist",
) -> argparse.Namespace:
    """A Megatron-LM `args` namespace describing the model and the target layout.

    It carries every attribute Megatron-LM's and Megatron-Bridge's checkpoint loaders read
    (`megatron_lm_args.LOADER_DEFAULTS`): Megatron-LM's default wherever the model sets nothing.
    """
    values = dict(
        num_layers=model.num_layers,
        encoder_num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        group_query_attention=model.num_query_groups != model.num_attention_heads,
        kv_channels=model.head_dim,
        max_position_embeddings=model.max_position_embeddings,
        seq_length=model.max_position_embeddings,
        position_embedding_type="rope",
        add_position_embedding=False,
        use_rotary_position_embeddings=True,
        rotary_base=model.rope.theta,
        rotary_percent=model.rope.partial_rotary_factor,
        rotary_interleaved=False,
        use_rope_scaling=_llama3(model.rope),
        rope_scaling_factor=model.rope.factor if _llama3(model.rope) else 8.0,
        rotary_seq_len_interpolation_factor=_linear_factor(model.rope),
        normalization="RMSNorm",
        norm_epsilon=model.norm_epsilon,
        layernorm_epsilon=model.norm_epsilon,
        apply_layernorm_1p=model.norm_offset,  # Megatron-LM's name of the (1 + weight) norm
        layernorm_zero_centered_gamma=model.norm_offset,
        swiglu=model.hidden_act == "silu",
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        untie_embeddings_and_output_weights=not model.tie_word_embeddings,
        vocab_size=model.vocab_size,
        padded_vocab_size=padded_vocab(model, layout, make_vocab_size_divisible_by),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        num_layers_per_virtual_pipeline_stage=(model.num_layers // (layout.pp * layout.vpp) if layout.vpp else None),
        decoder_first_pipeline_num_layers=layout.first_stage_layers,
        decoder_last_pipeline_num_layers=layout.last_stage_layers,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.expert_tp,
        transformer_impl="transformer_engine" if spec == "te" else "local",
        params_dtype=dtype,  # as given: torch's, or a `dtypes.DType` (saved as torch's by `dcp_writer.saved`)
        bf16=dtypes.of(dtype) == dtypes.BFLOAT16,
        fp16=dtypes.of(dtype) == dtypes.FLOAT16,
        ckpt_format=ckpt_format,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tokenizer_type="HuggingFaceTokenizer",
        hf_architecture=model.architecture,
        mtp_num_layers=model.mtp_layers or None,
        **_moe_args(model.moe),
    )
    values.update(_mla_kwargs(model))
    values.update(_gpt_oss_args(model))
    values.update(_gemma_args(model))
    values.update(linear_attention_kwargs(model))
    if model.mla is not None:  # how the HF weights order their rotary rows (megatron-core's are interleaved)
        values["hf_rope_interleave"] = model.mla.rope_interleave
    return argparse.Namespace(**(loader_defaults() | values))


def _gpt_oss_args(model: ModelSpec) -> dict[str, Any]:
    """Sinks, windows, every linear layer's bias, the clamped SwiGLU and GPTModel's YaRN under Megatron-LM's
    argument names (`hf_rope`: the RoPE description itself, which GPTModel's YaRN arguments do not hold whole)."""
    moe, attention = model.moe, _attention_kwargs(model)
    values: dict[str, Any] = {
        "add_bias_linear": model.o_bias,
        "softmax_type": attention.get("softmax_type", "vanilla"),
        "window_size": attention.get("window_size"),
        "window_attn_skip_freq": attention.get("window_attn_skip_freq"),
    }
    if moe is not None and moe.swiglu_limit is not None:
        values |= {"quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": moe.swiglu_limit}
    yarn = yarn_config_attributes(model)
    if yarn:
        values |= yarn | {"position_embedding_type": "yarn", "hf_rope": dataclasses.asdict(model.rope)}
    return values


def _gemma_args(model: ModelSpec) -> dict[str, Any]:
    """The GeGLU activation, post-norms, embedding scale, the sliding layers' RoPE and the softmax scale, under
    names of their own (`hf_...`: Megatron-LM has no arguments for them); nothing for a model without them."""
    values: dict[str, Any] = {}
    if model.hidden_act != "silu":
        values["hf_hidden_act"] = model.hidden_act
    if model.post_norms:
        values["hf_post_norms"] = True
    if model.embedding_scale:
        values["hf_embedding_scale"] = True
    if model.sliding_rope is not None:
        values["hf_sliding_rope"] = dataclasses.asdict(model.sliding_rope)
    if model.query_pre_attn_scalar is not None:
        values["hf_query_pre_attn_scalar"] = model.query_pre_attn_scalar
    return values


def _gemma_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """`ModelSpec` fields from `_gemma_args`' arguments and Megatron-LM's `apply_layernorm_1p`."""
    local = getattr(args, "hf_sliding_rope", None)
    scalar = getattr(args, "hf_query_pre_attn_scalar", None)
    return {
        "hidden_act": getattr(args, "hf_hidden_act", None) or "silu",
        "norm_offset": bool(getattr(args, "apply_layernorm_1p", False)),
        "post_norms": bool(getattr(args, "hf_post_norms", False)),
        "embedding_scale": bool(getattr(args, "hf_embedding_scale", False)),
        "sliding_rope": RopeSpec(**local) if isinstance(local, dict) else None,
        "query_pre_attn_scalar": float(scalar) if scalar is not None else None,
    }


def _gpt_oss_from_args(args: argparse.Namespace, num_layers: int) -> dict[str, Any]:
    """`ModelSpec` fields from `_gpt_oss_args`' arguments (nothing where they are absent)."""
    window = getattr(args, "window_size", None)
    pattern = getattr(args, "window_attn_skip_freq", None)
    if window is not None and not isinstance(pattern, list):
        raise ConfigError(f"checkpoint args window_attn_skip_freq={pattern!r}: only a per-layer list is read")
    fields: dict[str, Any] = {
        "o_bias": bool(getattr(args, "add_bias_linear", False)),
        "attention_sinks": getattr(args, "softmax_type", "vanilla") == "learnable",
        "sliding_window": None if window is None else int(window[0]) + 1,
    }
    if window is not None:
        fields["layer_types"] = tuple(SLIDING_ATTENTION if on else FULL_ATTENTION for on in pattern)
    rope = getattr(args, "hf_rope", None)
    if getattr(args, "position_embedding_type", "rope") == "yarn" and not getattr(args, "multi_latent_attention", 0):
        if not isinstance(rope, dict):
            raise ConfigError("checkpoint args describe YaRN without hf_rope; pass --hf-config")
        fields["rope"] = RopeSpec(**rope)
    return fields


def _moe_args(moe: MoeSpec | None) -> dict[str, Any]:
    """The MoE part of Megatron-LM's args: the TransformerConfig fields under Megatron-LM's argument names."""
    if moe is None:
        return {"num_experts": None}
    args = _moe_kwargs(moe, Layout())
    args["num_experts"] = args.pop("num_moe_experts")
    del args["expert_tensor_parallel_size"]  # recorded with the layout
    del args["moe_router_bias_update_rate"]  # a training setting, not the model's
    # the args describe the model as its HF config does (export writes `router_aux_loss_coef` back from them)
    return args | {"moe_aux_loss_coeff": moe.aux_loss_coeff, "moe_router_load_balancing_type": "aux_loss"}


def _linear_factor(rope: RopeSpec) -> float | None:
    """Linear RoPE's factor (megatron-core's `seq_len_interpolation_factor`); None for any other type."""
    return rope.factor if rope.rope_type == "linear" else None


def _llama3(rope: RopeSpec) -> bool:
    """Whether RoPE is Llama-3 scaled (megatron-core's `rope_scaling`, with its constants)."""
    return rope.rope_type == "llama3"


def _moe_from_args(args: argparse.Namespace, num_layers: int) -> MoeSpec | None:
    experts = getattr(args, "num_experts", None)
    if not experts:
        return None
    freq = getattr(args, "moe_layer_freq", 1)
    layers = tuple(bool(f) for f in freq) if isinstance(freq, list) else tuple(i % freq == 0 for i in range(num_layers))
    topk = args.moe_router_topk
    score_function = getattr(args, "moe_router_score_function", None) or "softmax"
    # megatron-core renormalises sigmoid weights exactly when top-k > 1, softmax ones unless `pre_softmax`
    sigmoid = score_function == "sigmoid"
    renormalize = topk > 1 if sigmoid else not getattr(args, "moe_router_pre_softmax", False)
    return MoeSpec(
        num_experts=experts,
        ffn_hidden_size=args.moe_ffn_hidden_size,
        topk=topk,
        moe_layers=layers,
        renormalize=renormalize,
        aux_loss_coeff=float(getattr(args, "moe_aux_loss_coeff", 0.0)),
        shared_expert_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        score_function=score_function,
        expert_bias=bool(getattr(args, "moe_router_enable_expert_bias", False)),
        topk_scaling_factor=getattr(args, "moe_router_topk_scaling_factor", None),
        num_groups=getattr(args, "moe_router_num_groups", None),
        group_topk=getattr(args, "moe_router_group_topk", None),
        router_fp32=getattr(args, "moe_router_dtype", None) == "fp32",
        expert_mlp_bias=bool(getattr(args, "add_bias_linear", False)),
        router_bias=bool(getattr(args, "add_bias_linear", False)),
        swiglu_limit=getattr(args, "activation_func_clamp_value", None) if getattr(args, "quick_geglu", 0) else None,
        swiglu_alpha=MCORE_QUICK_GELU_ALPHA,
    )


def _mla_from_args(args: argparse.Namespace) -> MlaSpec | None:
    """Multi-latent attention from Megatron-LM's argument names (megatron-core's field names)."""
    if not getattr(args, "multi_latent_attention", False):
        return None
    return MlaSpec(
        q_lora_rank=getattr(args, "q_lora_rank", None),
        kv_lora_rank=args.kv_lora_rank,
        qk_nope_head_dim=args.qk_head_dim,
        qk_rope_head_dim=args.qk_pos_emb_head_dim,
        v_head_dim=args.v_head_dim,
        rope_interleave=getattr(args, "hf_rope_interleave", True) is not False,
    )


def _rope_from_args(args: argparse.Namespace, theta: float, mla: bool) -> RopeSpec:
    """RoPE from Megatron-LM's argument names: YaRN where multi-latent attention says so, Llama-3 scaling with
    megatron-core's constants where `use_rope_scaling`, linear where `rotary_seq_len_interpolation_factor`, else
    plain (partial where `rotary_percent` < 1)."""
    partial = float(getattr(args, "rotary_percent", None) or 1.0)
    if mla and getattr(args, "rope_type", "yarn") == "yarn":
        all_dim = float(getattr(args, "mscale_all_dim", 0.0) or 0.0)
        return RopeSpec(
            theta=theta,
            rope_type="yarn",
            factor=float(args.rotary_scaling_factor),
            original_max_position_embeddings=int(getattr(args, "original_max_position_embeddings", 4096)),
            beta_fast=float(getattr(args, "beta_fast", 32.0)),
            beta_slow=float(getattr(args, "beta_slow", 1.0)),
            mscale=float(getattr(args, "mscale", 1.0)) if all_dim else None,
            mscale_all_dim=all_dim,
            partial_rotary_factor=partial,
        )
    linear = getattr(args, "rotary_seq_len_interpolation_factor", None)
    if linear is not None:
        return RopeSpec(theta=theta, rope_type="linear", factor=float(linear), partial_rotary_factor=partial)
    if getattr(args, "use_rope_scaling", False):
        return RopeSpec(
            theta=theta,
            rope_type="llama3",
            factor=float(args.rope_scaling_factor),
            partial_rotary_factor=partial,
            **MCORE_LLAMA3_ROPE,  # type: ignore[arg-type]
        )
    return RopeSpec(theta=theta, partial_rotary_factor=partial)


def from_megatron_args(args: argparse.Namespace) -> ModelSpec:
    """Rebuild a model's description from a Megatron-LM `args` namespace (a checkpoint without stored HF assets)."""

    def get(name: str, default: Any = None) -> Any:
        value = getattr(args, name, default)
        if value is None and default is None:
            raise ConfigError(f"checkpoint args lack {name!r}; pass --hf-config")
        return value

    heads = get("num_attention_heads")
    hidden = get("hidden_size")
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else heads
    gemma = _gemma_from_args(args)
    if not getattr(args, "swiglu", False) and gemma["hidden_act"] == "silu":
        raise ConfigError("checkpoint args describe a non-gated MLP (swiglu=False); only SwiGLU models are supported")
    if get("normalization", "LayerNorm") != "RMSNorm":
        raise ConfigError(f"checkpoint args normalization={args.normalization!r}; only RMSNorm is supported")
    architecture = getattr(args, "hf_architecture", None)
    mla = _mla_from_args(args)
    qk_norm = bool(getattr(args, "qk_layernorm", False)) and mla is None  # MLA's are its latents' norms
    qkv_bias = bool(getattr(args, "add_qkv_bias", False))
    num_layers = get("num_layers")
    moe = _moe_from_args(args, num_layers)
    if architecture is None:  # written by Megatron-LM: the registered architecture with these features
        shared = moe is not None and bool(moe.shared_expert_size)
        features = {"moe": moe is not None, "shared_expert": shared, "qk_norm": qk_norm, "qkv_bias": qkv_bias}
        features["mla"] = mla is not None
        features["post_norms"] = gemma["post_norms"]
        features["linear_attention"] = getattr(args, "experimental_attention_variant", None) == "gated_delta_net"
        if moe is not None:
            features["score_function"] = moe.score_function
        architecture = with_features(**features, experts=moe).hf_name
    fields = (
        {
            "rope": _rope_from_args(args, float(get("rotary_base")), mla is not None),
            "layer_types": (FULL_ATTENTION,) * num_layers,
        }
        | _gpt_oss_from_args(args, num_layers)
        | gemma
        | _linear_attention_from_args(args)
    )
    return ModelSpec(
        architecture=architecture,
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=get("ffn_hidden_size"),
        num_attention_heads=heads,
        num_query_groups=groups or heads,
        head_dim=getattr(args, "kv_channels", None) or hidden // heads,
        vocab_size=getattr(args, "vocab_size", None) or get("padded_vocab_size"),
        max_position_embeddings=get("max_position_embeddings"),
        # `norm_epsilon` in the args written here, `layernorm_epsilon` (the TransformerConfig name) in Megatron-LM's
        norm_epsilon=float(getattr(args, "norm_epsilon", None) or get("layernorm_epsilon", 1e-5)),
        tie_word_embeddings=not get("untie_embeddings_and_output_weights", False),
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        torch_dtype=params_dtype_name(getattr(args, "params_dtype", None)),
        moe=moe,
        mla=mla,
        mtp_layers=getattr(args, "mtp_num_layers", None) or 0,
        **fields,
    )
