"""The learning-rate schedule's section, shared by both training backends (`megatron_cfg.scheduler`,
`dtensor_cfg.scheduler`), and its checks.

The keys are megatron-core's `OptimizerParamScheduler` arguments; the DTensor backend computes the same schedule
(`backends.dtensor.lr_schedule`). Plain data, standard library only (a config is validated without torch).
"""

from dataclasses import dataclass

from hf_mcore_bridge.grpo.errors import real_number, require

__all__ = ["SchedulerConfig", "validate_schedule"]


@dataclass(frozen=True)
class SchedulerConfig:
    """megatron-core's `OptimizerParamScheduler` (learning rate and weight decay per step)."""

    lr_warmup_steps: int = 0
    """Optimizer steps of linear warm-up from `lr_warmup_init` to the optimizer's `lr`."""
    lr_warmup_init: float = 0.0
    """Learning rate at step 0 of the warm-up."""
    lr_decay_steps: int | None = None
    """Optimizer steps over which the rate decays to `min_lr`; None: the run's total optimizer steps."""
    lr_decay_style: str = "constant"
    """`constant`, `linear`, `cosine`, `inverse-square-root` or `WSD` (megatron-core's names)."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""


def validate_schedule(schedule: SchedulerConfig, max_lr: float | None, where: str) -> None:
    """The checks megatron-core's `OptimizerParamScheduler` asserts, made in the parent with the key's name
    (`where`: the section's dotted path); `max_lr`: the optimizer's learning rate, where known."""
    min_lr = real_number(schedule.min_lr, f"{where}.min_lr")
    init = real_number(schedule.lr_warmup_init, f"{where}.lr_warmup_init")
    require(min_lr >= 0, f"{where}.min_lr={min_lr:g} must be >= 0")
    require(init >= 0, f"{where}.lr_warmup_init={init:g} must be >= 0")
    require(schedule.lr_warmup_steps >= 0, f"{where}.lr_warmup_steps={schedule.lr_warmup_steps} must be >= 0")
    decay = schedule.lr_decay_steps
    require(
        decay is None or decay > schedule.lr_warmup_steps,
        f"{where}.lr_decay_steps={decay} must be larger than lr_warmup_steps={schedule.lr_warmup_steps}",
    )
    if max_lr is not None:
        require(min_lr <= max_lr, f"{where}.min_lr={min_lr:g} is above the learning rate {max_lr:g}")
        require(init <= max_lr, f"{where}.lr_warmup_init={init:g} is above the learning rate {max_lr:g}")
