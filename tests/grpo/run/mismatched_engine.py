"""Rank functions for `test_offpolicy`: a trainer rank whose rollout engine disagrees with the trainer (for the
engine-mismatch corrections), and a check of the micro-batch padding over expert-parallel ranks.

On CPU in fp32 the embedded engine and the trainer agree on every log-prob to about 1e-6, so `tis` and `icepop`
weights are all ~1 and a test could not tell a correction from none. A real engine differs (bf16 kernels, stale
weights); here every rank shifts each sampled token's engine log-prob of the step's gathered rollouts by the
same fixed, position-dependent amount in [-0.3, 0.3] before they are trained on and logged, so `rollouts.jsonl`
holds exactly what the trainer saw. The shift is applied inside the spawned rank (a monkeypatch in the test
process would not reach it).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

SHIFT = 0.3
"""Largest engine log-prob shift: engine/trainer probability ratios span about [0.74, 1.35]."""


def shifted(logprobs: tuple[float, ...], index: int) -> tuple[float, ...]:
    """The engine log-probs of rollout `index` of a step, shifted by a deterministic amount per token."""
    return tuple(lp + SHIFT * math.sin(1.7 * (j + 1) + 0.9 * index) for j, lp in enumerate(logprobs))


def train_rank_with_mismatched_engine(config: Any, prepared: Any) -> None:
    """`trainer._train_rank` with the engine log-probs of every rollout shifted (alike on every rank)."""
    from hf_mcore_bridge.grpo.run import trainer

    generate = trainer._generate_rollouts

    def mismatched(ctx: Any, step: int) -> tuple[list[Any], dict[str, float]]:
        rollouts, stats = generate(ctx, step)
        return [
            dataclasses.replace(r, engine_logprobs=shifted(r.engine_logprobs, i)) for i, r in enumerate(rollouts)
        ], stats

    trainer._generate_rollouts = mismatched
    trainer._train_rank(config, prepared)


def expert_padding_rank(out: str) -> None:
    """Two expert-parallel ranks whose micro-batches differ in length (then in count, then in rows): the first
    call's padded lengths and the other calls' errors, saved by rank 0 as JSON."""
    import json

    import torch.distributed as dist

    from hf_mcore_bridge.errors import BridgeError
    from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches
    from hf_mcore_bridge.grpo.backends.megatron.policy import _same_lengths_over_experts

    rank = dist.get_rank()
    completions = [(3, 4), (5,)] if rank == 0 else [(3, 4, 5, 6, 7), (5, 6)]
    rollouts = [Rollout((1, 2), c, (0.0,) * len(c)) for c in completions]
    padded = _same_lengths_over_experts(make_microbatches(rollouts, 1), torch.device("cpu"))
    errors = []
    # then 1 vs 2 micro-batches, and one micro-batch of 1 vs 2 rows
    for unequal in (make_microbatches(rollouts[: rank + 1], 1), make_microbatches(rollouts[: rank + 1], 2)):
        try:
            _same_lengths_over_experts(unequal, torch.device("cpu"))
            errors.append("")
        except BridgeError as err:
            errors.append(str(err))
    if rank == 0:
        result = {"lengths": [b.seq_len for b in padded], "masks": [b.mask.sum().item() for b in padded]}
        Path(out).write_text(json.dumps(result | {"errors": errors}))
