"""The megatron-core backend's section of a run's config (`policy.megatron_cfg`) and its validation.

Plain data: parallel sizes, micro-batching, and three free-form dicts forwarded as given to megatron-core's
`TransformerConfig`, `OptimizerConfig` and `DistributedDataParallelConfig`. `validate_megatron` makes the cheap
checks (standard library only); `validate_forwarded` checks the forwarded keys against those classes' fields, so it
imports megatron-core (seconds) and runs last. Keys the trainer derives itself (model shape, parallel sizes, dtype)
are refused under `transformer`. The parallel layout is read from the section once, by the run's plan
(`megatron_layout`, called by `run.plan.parallel_dims`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.transformer_impl import check_transformer_impl
from hf_mcore_bridge.grpo.algorithm.options import Aggregation
from hf_mcore_bridge.grpo.backends.schedule import SchedulerConfig, validate_schedule
from hf_mcore_bridge.grpo.errors import GRPOConfigError, real_number, require, unknown_key

__all__ = [
    "MegatronConfig",
    "megatron_config_classes",
    "megatron_layout",
    "validate_forwarded",
    "validate_megatron",
]

WHERE = "policy.megatron_cfg"
"""The section's dotted path in a run's config (error messages name keys by it)."""


@dataclass(frozen=True)
class MegatronConfig:
    """How megatron-core runs the policy: parallel sizes plus keys forwarded to its config classes."""

    enabled: bool = True
    """Train with megatron-core (the default backend); set false to train with `policy.dtensor_cfg` instead."""
    tensor_model_parallel_size: int = 1
    """TP: heads, query groups, FFN width and vocabulary split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """PP: decoder layers split into this many stages."""
    context_parallel_size: int = 1
    """CP: every sequence split over this many ranks (megatron-core's load-balanced 2 x CP chunks; keys and values
    all-gathered in the project's attention, `context_parallel`); rows are padded per sequence to 2 x CP."""
    expert_model_parallel_size: int = 1
    """EP: routed experts split over this many ranks (MoE models)."""
    expert_tensor_parallel_size: int | None = None
    """ETP: each expert's weights split over this many ranks; None: the same as TP (megatron-core's default)."""
    sequence_parallel: bool = False
    """megatron-core's sequence parallelism (TP > 1 only)."""
    micro_batch_size: int = 4
    """Samples per micro-batch of the training and log-prob forward passes (padded to their longest)."""
    sequence_packing: bool = False
    """Pack whole rollouts into single rows with a block-diagonal causal mask instead (token aggregation only)."""
    max_tokens_per_microbatch: int = 1024
    """Row length budget of a packed micro-batch."""
    make_vocab_size_divisible_by: int = 128
    """Vocabulary padding rule (times TP), as Megatron-LM; padded logits are masked out of every softmax."""
    moe_router_bias_update_rate: float = 0.0
    """Routers with an expert score bias (GLM-4.5, DeepSeek-V3): how far megatron-core moves each expert's bias
    after every optimizer step, towards balanced expert loads (its `moe_router_bias_update_rate`, whose own default
    is 1e-3). 0, the default here as in NeMo-RL's GRPO recipes: the bias stays as the checkpoint has it, so routing
    changes only through the loss's gradients; a positive rate changes the model beyond what the objective asks
    (the KL reference keeps the initial biases)."""
    transformer: Mapping[str, Any] = field(default_factory=dict)
    """Extra `TransformerConfig` keys, forwarded as given (e.g. `recompute_granularity`)."""
    optimizer: Mapping[str, Any] = field(default_factory=lambda: {"lr": 1e-6, "weight_decay": 0.01, "clip_grad": 1.0})
    """`OptimizerConfig` keys, forwarded as given (`lr`, `weight_decay`, `adam_beta1`, `clip_grad`, ...)."""
    ddp: Mapping[str, Any] = field(default_factory=dict)
    """`DistributedDataParallelConfig` keys, forwarded as given (e.g. `overlap_grad_reduce`)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate and weight-decay schedule."""


def megatron_layout(section: MegatronConfig) -> Layout:
    """The parallel layout the section asks for (read once, into the run's plan)."""
    return Layout(
        tp=section.tensor_model_parallel_size,
        pp=section.pipeline_model_parallel_size,
        cp=section.context_parallel_size,
        ep=section.expert_model_parallel_size,
        etp=section.expert_tensor_parallel_size,
    )


def validate_megatron(section: MegatronConfig, aggregation: Aggregation) -> None:
    """The section's cheap checks (no megatron-core import); `aggregation`: the loss's (`loss_fn.aggregation`),
    which packed rows need to be per token. Sizes are checked whether or not the backend is enabled; the
    optimizer and schedule only where it is."""
    for name in ("tensor_model", "pipeline_model", "context", "expert_model"):
        size = getattr(section, f"{name}_parallel_size")
        require(size >= 1, f"{WHERE}.{name}_parallel_size={size} must be >= 1")
    etp = section.expert_tensor_parallel_size
    require(etp is None or etp >= 1, f"{WHERE}.expert_tensor_parallel_size={etp} must be >= 1")
    require(
        section.context_parallel_size == 1 or not section.transformer.get("attention_dropout"),
        f"{WHERE}.context_parallel_size > 1 takes no transformer.attention_dropout (the context-parallel"
        " attention does not implement dropout)",
    )
    require(
        not section.sequence_parallel or section.tensor_model_parallel_size > 1,
        f"{WHERE}.sequence_parallel needs tensor_model_parallel_size > 1",
    )
    require(section.micro_batch_size >= 1, f"{WHERE}.micro_batch_size must be >= 1")
    require(section.max_tokens_per_microbatch >= 2, f"{WHERE}.max_tokens_per_microbatch must be >= 2")
    divisible_by = section.make_vocab_size_divisible_by
    require(divisible_by >= 1, f"{WHERE}.make_vocab_size_divisible_by={divisible_by} must be >= 1")
    require(
        not section.sequence_packing or aggregation is Aggregation.TOKEN,
        f"{WHERE}.sequence_packing needs loss_fn.aggregation=token (a packed row holds many sequences)",
    )
    impl = section.transformer.get("transformer_impl")  # default: transformer_impl.default_transformer_impl()
    try:
        if impl is not None:
            check_transformer_impl(impl)
    except ValueError as err:
        raise GRPOConfigError(f"{WHERE}.transformer.{err}") from None
    if section.enabled:
        _validate_optimizer(section)
        rate = real_number(section.moe_router_bias_update_rate, f"{WHERE}.moe_router_bias_update_rate")
        require(rate >= 0, f"{WHERE}.moe_router_bias_update_rate={rate:g} must be >= 0")
        lr = section.optimizer.get("lr")
        validate_schedule(section.scheduler, None if lr is None else float(lr), f"{WHERE}.scheduler")


_OPTIMIZER_RANGES = {
    "lr": (0.0, None),
    "min_lr": (0.0, None),
    "weight_decay": (0.0, None),
    "clip_grad": (0.0, None),
    "adam_beta1": (0.0, 1.0),
    "adam_beta2": (0.0, 1.0),
}
"""Forwarded `OptimizerConfig` keys and their ranges, [low, high): megatron-core asserts them only inside a rank."""


def _validate_optimizer(section: MegatronConfig) -> None:
    for key, (low, high) in _OPTIMIZER_RANGES.items():
        if key not in section.optimizer:
            continue
        where = f"{WHERE}.optimizer.{key}"
        value = real_number(section.optimizer[key], where)
        require(value >= low, f"{where}={value:g} must be >= {low:g}")
        if high is not None:
            require(value < high, f"{where}={value:g} must be < {high:g}")
    if "adam_eps" in section.optimizer:
        eps = real_number(section.optimizer["adam_eps"], f"{WHERE}.optimizer.adam_eps")
        require(eps > 0, f"{WHERE}.optimizer.adam_eps={eps:g} must be > 0")


_DERIVED_TRANSFORMER_KEYS = frozenset(
    {
        "num_layers",
        "hidden_size",
        "ffn_hidden_size",
        "num_attention_heads",
        "num_query_groups",
        "kv_channels",
        "tensor_model_parallel_size",
        "pipeline_model_parallel_size",
        "context_parallel_size",
        "expert_model_parallel_size",
        "sequence_parallel",
        "params_dtype",
        "pipeline_dtype",
        "bf16",
        "fp16",
    }
)
"""TransformerConfig keys the trainer sets from the model and the parallel sizes."""

_EXPLICIT_TRANSFORMER_KEYS = {"moe_router_bias_update_rate": f"{WHERE}.moe_router_bias_update_rate"}
"""TransformerConfig keys that have a key of their own (documented default) instead of `transformer.<key>`."""


def megatron_config_classes() -> dict[str, type]:
    """The megatron-core classes that `megatron_cfg.transformer/optimizer/ddp` are forwarded to."""
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    return {"transformer": TransformerConfig, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


def validate_forwarded(section: MegatronConfig) -> None:
    """Every forwarded key is a field of its megatron-core class, and none is one the trainer sets (imports
    megatron-core: call it after every cheap check)."""
    for name, cls in megatron_config_classes().items():
        valid = [f.name for f in dataclasses.fields(cls)]
        for key in getattr(section, name):
            if key not in valid:
                raise unknown_key(key, valid, f"{WHERE}.{name}.")
            if name == "transformer" and key in _EXPLICIT_TRANSFORMER_KEYS:
                raise GRPOConfigError(
                    f"{WHERE}.transformer.{key} is set by {_EXPLICIT_TRANSFORMER_KEYS[key]}; set that instead"
                )
            if name == "transformer" and key in _DERIVED_TRANSFORMER_KEYS:
                raise GRPOConfigError(
                    f"{WHERE}.transformer.{key} is set by the trainer (from the model or the parallel "
                    f"sizes); set the parallel sizes under {WHERE} instead"
                )
