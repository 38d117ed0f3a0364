"""Group-relative advantages: one scalar reward per completion in, one scalar advantage per completion out.

Rewards arrive flat, `[num_prompts * group_size]`, with the `group_size` completions of one prompt stored next to
each other (prompt 0's group first, then prompt 1's, ...). Every completion of a group gets the same baseline
treatment; the advantage is later broadcast over the completion's tokens by the loss.

Choices and simplifications:
- With the group-mean baseline the divisor is the sample (Bessel-corrected, `n - 1`) standard deviation of the
  whole group, as in the common GRPO implementations, and `eps` is added to it rather than to the variance.
- With the leave-one-out baseline the numerator is `r_i - mean(r_j for j != i)`, which equals
  `n / (n - 1) * (r_i - mean(r))`, and the divisor is chosen by `LeaveOneOutStd`:
  - `others` (the default, NeMo-RL's `calculate_baseline_and_std_per_prompt` with `use_leave_one_out_baseline`):
    the Bessel-corrected std of the OTHER `n - 1` rewards, `sqrt(sum_{j != i} (r_j - b_i)^2 / (n - 2))`, one per
    completion. Where it is 0 (the others all equal, or a group of two, which leaves one "other") the advantage is
    left undivided, as NeMo-RL does; so in [1, 0, 0, 0] the first completion gets exactly 1.
  - `group`: the std of the whole group, as without leave-one-out, so switching the baseline rescales a group
    uniformly by `n / (n - 1)` and never divides by a zero spread.
- A group whose rewards are all equal carries no learning signal; its advantages are set to exactly 0 instead of
  relying on `0 / (0 + eps)`, because rounding in the mean of equal non-integer rewards would otherwise leak tiny
  non-zero values scaled up by `1 / eps`.
- Groups of one completion are rejected: there is no baseline to compare against.
"""

from dataclasses import dataclass

import torch

from hf_mcore_bridge.grpo.algorithm.options import LeaveOneOutStd

__all__ = ["AdvantageConfig", "LeaveOneOutStd", "constant_reward_groups", "group_advantages"]


@dataclass(frozen=True)
class AdvantageConfig:
    """How rewards within a group are turned into advantages."""

    normalize_std: bool = True
    """Divide by the group's reward standard deviation (GRPO). False subtracts the baseline only (Dr. GRPO)."""

    leave_one_out: bool = False
    """Baseline each completion with the mean of the other completions of its group instead of the group mean."""

    leave_one_out_std: LeaveOneOutStd = LeaveOneOutStd.OTHERS
    """With `leave_one_out` and `normalize_std`: divide by the std of the other rewards (NeMo-RL) or of the group."""

    eps: float = 1e-6
    """Added to the standard deviation before dividing, so that a near-constant group does not explode."""

    def __post_init__(self) -> None:
        if self.eps < 0:
            raise ValueError(f"AdvantageConfig.eps must be >= 0, got {self.eps}")


def _grouped(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """View `rewards: [num_prompts * group_size]` as `[num_prompts, group_size]` in a floating dtype."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 for a group baseline, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    return rewards.view(-1, group_size)


def _std_of_others(grouped: torch.Tensor, baseline: torch.Tensor) -> torch.Tensor:
    """Bessel-corrected std of each completion's other rewards; 0 where only one other exists.

    grouped, baseline (the mean of the others): [num_prompts, n]. Returns [num_prompts, n]. Two-pass (deviations
    from the others' mean) rather than `E[r^2] - E[r]^2`, which cancels badly for large rewards.
    """
    n = grouped.shape[1]
    if n < 3:
        return torch.zeros_like(grouped)
    others = ~torch.eye(n, dtype=torch.bool, device=grouped.device)  # [i, j]: j is one of i's others
    deviations = grouped.unsqueeze(1) - baseline.unsqueeze(2)  # [P, i, j] = r_j - b_i
    return (deviations.square() * others).sum(dim=2).div(n - 2).sqrt()


def constant_reward_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Which groups have all rewards equal (no learning signal; DAPO's dynamic sampling drops them).

    rewards: [num_prompts * group_size], grouped contiguously. Returns a bool tensor [num_prompts].
    """
    grouped = _grouped(rewards, group_size)
    return grouped.amax(dim=1) == grouped.amin(dim=1)


def group_advantages(rewards: torch.Tensor, group_size: int, config: AdvantageConfig | None = None) -> torch.Tensor:
    """Advantages of each completion relative to the other completions of its prompt.

    rewards: [num_prompts * group_size], grouped contiguously. Returns advantages of the same shape, in the
    rewards' floating dtype (float32 for integer rewards).
    """
    config = config or AdvantageConfig()
    grouped = _grouped(rewards, group_size)
    group_sum = grouped.sum(dim=1, keepdim=True)
    baseline = (group_sum - grouped) / (group_size - 1) if config.leave_one_out else group_sum / group_size
    advantages = grouped - baseline
    if config.normalize_std and config.leave_one_out and config.leave_one_out_std is LeaveOneOutStd.OTHERS:
        std = _std_of_others(grouped, baseline)
        advantages = torch.where(std > 0, advantages / (std + config.eps), advantages)
    elif config.normalize_std:
        advantages = advantages / (grouped.std(dim=1, keepdim=True) + config.eps)
    constant = (grouped.amax(dim=1) == grouped.amin(dim=1)).unsqueeze(1)
    advantages = advantages.masked_fill(constant, 0.0)
    return advantages.reshape(rewards.shape)
