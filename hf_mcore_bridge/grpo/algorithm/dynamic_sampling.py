"""DAPO's dynamic sampling: a step trains only on groups whose rewards differ, generating more until it has enough.

A group whose completions all got the same reward has zero advantage everywhere (`advantages.group_advantages`),
so it adds nothing to the policy gradient but still dilutes the token or sequence count the loss is divided by
(and still costs its forward and backward passes). `GroupPool` collects each generation round's rollouts group by
group, keeps the groups with reward variance and counts the others; the trainer generates rounds until the pool
holds `wanted` groups or `max_rounds` rounds have run (`grpo.dynamic_sampling`).

Assumes the rollouts of a round come grouped contiguously, `group_size` completions of one prompt after another
(the trainer's gathered order). Simplification: when the rounds run out before enough groups have variance, the
batch is filled with the first dropped groups (zero advantage: they shape only the loss's normaliser and, with a KL
term, its KL), so that every step trains on `wanted` groups and the batch still splits over data-parallel ranks
and mini-batches as validated; the number filled is logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from hf_mcore_bridge.grpo.algorithm.batching import Rollout

__all__ = ["GroupPool", "groups_with_variance"]


def groups_with_variance(rewards: Sequence[float], group_size: int) -> list[bool]:
    """Per group of `rewards` (`[num_groups * group_size]`, grouped contiguously): whether its rewards are not all
    equal."""
    if group_size < 1 or len(rewards) % group_size:
        raise ValueError(f"{len(rewards)} rewards do not form groups of {group_size}")
    groups = [rewards[i : i + group_size] for i in range(0, len(rewards), group_size)]
    return [max(group) != min(group) for group in groups]


@dataclass
class GroupPool:
    """The groups of a step's generation rounds: those with reward variance kept in order, the others dropped."""

    wanted: int
    """Groups a step trains on (`grpo.num_prompts_per_step`)."""
    group_size: int
    """Completions per group (`grpo.num_generations_per_prompt`)."""
    kept: list[list[Rollout]] = field(default_factory=list)
    dropped: list[list[Rollout]] = field(default_factory=list)
    rounds: int = 0
    """Rounds added so far."""

    def add(self, rollouts: Sequence[Rollout]) -> None:
        """One round's rollouts, grouped contiguously."""
        size = self.group_size
        varied = groups_with_variance([r.reward for r in rollouts], size)
        for index, has_variance in enumerate(varied):
            (self.kept if has_variance else self.dropped).append(list(rollouts[index * size : (index + 1) * size]))
        self.rounds += 1

    @property
    def full(self) -> bool:
        """Whether enough groups with variance have been kept."""
        return len(self.kept) >= self.wanted

    def batch(self) -> tuple[list[Rollout], int]:
        """The step's rollouts: the first `wanted` kept groups, filled with the first dropped ones where too few
        were kept; and how many groups were filled so."""
        groups = self.kept[: self.wanted]
        filled = self.dropped[: self.wanted - len(groups)]
        if len(groups) + len(filled) < self.wanted:
            raise ValueError(f"the pool holds {len(groups) + len(filled)} groups, fewer than {self.wanted}")
        return [rollout for group in groups + filled for rollout in group], len(filled)
