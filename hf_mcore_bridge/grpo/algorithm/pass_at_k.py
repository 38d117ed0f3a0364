"""Validation metrics as the field reports them: pass@1 averaged over several samples a prompt, and pass@k.

A validation prompt gets `n = grpo.val_num_generations` completions (greedy when n is 1). A completion counts as
correct when its reward is at least 1 (what the built-in rewards give a right answer). For a prompt with `c`
correct of `n`, pass@k is the unbiased estimator of Chen et al. (2021), `1 - C(n-c, k) / C(n, k)`: the chance
that at least one of `k` completions drawn without replacement from the `n` is correct; it is averaged over the
prompts. pass@1 is then the mean correctness. The k reported are the powers of two below `n`, and `n`.

Metric names (stable; MLflow allows no `@`): `val_reward` (mean reward of all samples), `val_pass_at_{k}`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["pass_at_k", "reported_ks", "validation_metrics"]

CORRECT = 1.0
"""A reward at least this counts as a correct completion."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k of one prompt with `c` correct of `n` samples (`1 <= k <= n`)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    # the product form of 1 - C(n-c, k) / C(n, k): no huge binomials
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def reported_ks(n: int) -> list[int]:
    """The k reported for `n` samples a prompt: 1, 2, 4, ... below `n`, and `n`."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) < n]
    return [*ks, n]


def validation_metrics(rewards: Sequence[Sequence[float]]) -> dict[str, float]:
    """`val_reward` and `val_pass_at_{k}` from each prompt's rewards (every prompt has the same number)."""
    if not rewards or len({len(r) for r in rewards}) != 1 or not rewards[0]:
        raise ValueError("validation needs the same, nonzero number of rewards for every prompt")
    n = len(rewards[0])
    metrics = {"val_reward": sum(map(sum, rewards)) / (n * len(rewards))}
    for k in reported_ks(n):
        scores = [pass_at_k(n, sum(r >= CORRECT for r in prompt), k) for prompt in rewards]
        metrics[f"val_pass_at_{k}"] = sum(scores) / len(scores)
    return metrics
