"""The learning rate per optimizer step as megatron-core's `OptimizerParamScheduler` computes it, for torch optimizers.

`scheduled_lr` is megatron-core's `get_lr` as a pure function of the step, so a `SchedulerConfig` means the same
thing for both training backends; `lr_scheduler` wraps it in torch's `LambdaLR` (which multiplies the optimizer's
`lr`, the peak rate, by a factor per step).

Simplifications: the `WSD` style is not reproduced, and weight decay stays constant (the megatron side is also
configured with a constant weight decay).
"""

from __future__ import annotations

import math

import torch

from hf_mcore_bridge.grpo.backends.dtensor.config import SUPPORTED_STYLES
from hf_mcore_bridge.grpo.backends.schedule import SchedulerConfig

__all__ = ["decay_steps", "lr_scheduler", "scheduled_lr"]


def decay_steps(schedule: SchedulerConfig, total_optimizer_steps: int) -> int:
    """The steps the rate decays over: `lr_decay_steps`, or the run's total (at least one past the warm-up)."""
    return schedule.lr_decay_steps or max(total_optimizer_steps, schedule.lr_warmup_steps + 1)


def scheduled_lr(step: int, schedule: SchedulerConfig, max_lr: float, total_optimizer_steps: int) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up, then the decay style down to `min_lr`."""
    warmup, min_lr = schedule.lr_warmup_steps, schedule.min_lr
    if warmup > 0 and step <= warmup:
        return schedule.lr_warmup_init + (max_lr - schedule.lr_warmup_init) * step / warmup
    style = schedule.lr_decay_style
    if style == "constant":
        return max_lr
    total = decay_steps(schedule, total_optimizer_steps)
    if step > total:
        return min_lr
    if style == "inverse-square-root":
        return max(min_lr, max_lr * math.sqrt(max(warmup, 1)) / math.sqrt(max(step, 1)))
    ratio = (step - warmup) / (total - warmup)
    if style == "linear":
        coeff = 1.0 - ratio
    elif style == "cosine":
        coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
    else:
        raise ValueError(f"lr_decay_style={style!r}: one of {', '.join(SUPPORTED_STYLES)}")
    return min_lr + coeff * (max_lr - min_lr)


def lr_scheduler(
    optimizer: torch.optim.Optimizer, schedule: SchedulerConfig, max_lr: float, total_optimizer_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """A `LambdaLR` giving every parameter group `scheduled_lr(step)`; the groups' `lr` must be `max_lr`."""

    def factor(step: int) -> float:
        return scheduled_lr(step, schedule, max_lr, total_optimizer_steps) / max_lr if max_lr else 0.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
