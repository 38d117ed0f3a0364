"""The DTensor backend's section of a run's config (`policy.dtensor_cfg`) and its validation.

Plain data, standard library only (a config is validated without torch). The section's sizes are read once, by the
run's plan (`dtensor_sizes`, called by `run.plan.parallel_dims`): `data_parallel_shard_size x
tensor_parallel_size` ranks, the shard size derived from the cluster's ranks when not given.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hf_mcore_bridge.grpo.algorithm.options import Aggregation
from hf_mcore_bridge.grpo.backends.schedule import SchedulerConfig, validate_schedule
from hf_mcore_bridge.grpo.errors import require

__all__ = ["DTENSOR_CP_REFUSAL", "SUPPORTED_STYLES", "DTensorConfig", "dtensor_sizes", "validate_dtensor"]

WHERE = "policy.dtensor_cfg"
"""The section's dotted path in a run's config (error messages name keys by it)."""

SUPPORTED_STYLES = ("constant", "linear", "cosine", "inverse-square-root")
"""`lr_decay_style` values the DTensor backend's scheduler (`backends.dtensor.lr_schedule`) implements."""


@dataclass(frozen=True)
class DTensorConfig:
    """The DTensor training backend: the HF transformers model sharded with FSDP2, optional tensor parallelism."""

    enabled: bool = False
    """Train the HF model with FSDP2 instead of megatron-core (needs `policy.megatron_cfg.enabled: false`)."""
    tensor_parallel_size: int = 1
    """TP over DTensor: attention heads and MLP width split over this many ranks (Llama-family models)."""
    context_parallel_size: int = 1
    """CP over DTensor: refused above 1 (`DTENSOR_CP_REFUSAL`); context parallelism runs on the megatron-core
    backend (`policy.megatron_cfg.context_parallel_size`)."""
    data_parallel_shard_size: int | None = None
    """FSDP2 ranks the parameters, gradients and optimizer state are sharded over (each trains on its share of
    every mini-batch); None: `cluster.gpus_per_node / tensor_parallel_size`, or 1 without `gpus_per_node`."""
    activation_checkpointing: bool = False
    """Recompute each decoder layer's activations in backward (transformers' activation checkpointing)."""
    defer_gradient_sync: bool = False
    """Reduce-scatter gradients once per mini-batch (after its last micro-batch) instead of after every micro-batch
    (FSDP2's default). Fewer collectives, but each rank then holds the unsharded fp32 gradients between
    micro-batches: 32 GB for an 8B model, which ran out of memory on 2 H200s in `scripts/bench_training.py`."""
    micro_batch_size: int = 4
    """Samples per micro-batch of the training and log-prob forward passes (padded to their longest)."""
    sequence_packing: bool = False
    """Pack whole rollouts into single rows (positions restart per rollout) instead (token aggregation only)."""
    max_tokens_per_microbatch: int = 1024
    """Row length budget of a packed micro-batch."""
    lr: float = 1e-6
    """Peak learning rate of AdamW (the schedule's `max_lr`)."""
    weight_decay: float = 0.01
    """AdamW's decoupled weight decay, applied to matrices only (not to biases and norms, as megatron-core)."""
    betas: tuple[float, ...] = (0.9, 0.999)
    """AdamW's (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW's epsilon."""
    clip_grad: float = 1.0
    """Gradients are scaled to this global L2 norm at most (0: no clipping)."""
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    """Learning-rate schedule, as for megatron-core (`WSD` excepted)."""


DTENSOR_CP_REFUSAL = (
    "policy.dtensor_cfg.context_parallel_size > 1 is not supported: torch's context_parallel ring attention"
    " replaces only the CUDA SDPA kernels (flash, efficient, cuDNN) and takes no attention mask, so it cannot be"
    " checked exactly on CPU and packed rows cannot go through it; use policy.megatron_cfg.context_parallel_size"
)
"""Why the DTensor backend has no context parallelism (torch 2.13's `_context_parallel._attention` dispatch table)."""


def dtensor_sizes(section: DTensorConfig, cluster_ranks: int | None) -> tuple[int, int]:
    """(data_parallel_shard_size, tensor_parallel_size); the shard size defaults to `cluster_ranks /
    tensor_parallel_size` (`cluster.gpus_per_node x num_nodes`), or 1 where the cluster's size is not given."""
    tp = section.tensor_parallel_size
    derived = cluster_ranks // tp if cluster_ranks and tp >= 1 else 1
    return section.data_parallel_shard_size or derived, tp


def validate_dtensor(section: DTensorConfig, dtype: str, aggregation: Aggregation, cluster_ranks: int | None) -> None:
    """The section's checks, against the policy's `dtype`, the loss's `aggregation` and the ranks the cluster
    section starts (None: not given, the shard size is then derived)."""
    tp, dp_shard = section.tensor_parallel_size, section.data_parallel_shard_size
    require(tp >= 1, f"{WHERE}.tensor_parallel_size={tp} must be >= 1")
    require(dp_shard is None or dp_shard >= 1, f"{WHERE}.data_parallel_shard_size={dp_shard} must be >= 1")
    require(section.context_parallel_size == 1, DTENSOR_CP_REFUSAL)
    if cluster_ranks is not None:
        require(
            cluster_ranks % tp == 0 and (dp_shard is None or cluster_ranks == dp_shard * tp),
            f"cluster.gpus_per_node x num_nodes={cluster_ranks} must equal {WHERE}.data_parallel_shard_size x"
            " tensor_parallel_size"
            f" ({dp_shard or 'derived'} x {tp})",
        )
    require(dtype != "fp16", "policy.dtype=fp16 is not supported by the DTensor backend; use bf16")
    require(section.micro_batch_size >= 1, f"{WHERE}.micro_batch_size must be >= 1")
    require(section.max_tokens_per_microbatch >= 2, f"{WHERE}.max_tokens_per_microbatch must be >= 2")
    require(
        not section.sequence_packing or aggregation is Aggregation.TOKEN,
        f"{WHERE}.sequence_packing needs loss_fn.aggregation=token (a packed row holds many sequences)",
    )
    require(len(section.betas) == 2, f"{WHERE}.betas must be two numbers (beta1, beta2), got {list(section.betas)}")
    require(section.lr >= 0 and section.eps > 0 and section.clip_grad >= 0, f"{WHERE}: lr, eps, clip_grad must be >= 0")
    require(section.weight_decay >= 0, f"{WHERE}.weight_decay={section.weight_decay:g} must be >= 0")
    validate_schedule(section.scheduler, section.lr, f"{WHERE}.scheduler")
    style = section.scheduler.lr_decay_style
    require(
        style in SUPPORTED_STYLES,
        f"{WHERE}.scheduler.lr_decay_style={style!r}: one of {', '.join(SUPPORTED_STYLES)}",
    )
