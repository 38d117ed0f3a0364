"""Rank function for `test_router_replay`: a trainer rank whose MoE routers' expert score biases move between every
generation and the training on its rollouts.

In GLM-4.5's sigmoid router the score bias (`e_score_correction_bias`, megatron-core's `router.expert_bias`) only
chooses the experts: the weights are the chosen experts' unbiased scores. Moving it after the engine generated
therefore changes which experts the trainer's own top-k picks for some tokens but nothing else; replaying the
engine's choice must give back the engine's log-probs exactly (within fp32 rounding). The bias moves again every
step, after the previous refit gave the engine the last move, so the two always differ. Applied inside the spawned
rank (a monkeypatch in the test process would not reach it), alike on every rank (seeded by step and layer).
"""

from __future__ import annotations

from typing import Any

import torch

BIAS_MOVE = 0.5
"""Spread of the move of each expert's score bias: scores are sigmoids in (0, 1), so it reorders many choices."""


def move_expert_biases(module: torch.nn.Module, step: int) -> int:
    """Add a seeded random vector to every megatron-core router's expert bias; returns how many moved."""
    moved = 0
    for router in module.modules():
        bias = getattr(router, "expert_bias", None)
        if isinstance(bias, torch.Tensor) and getattr(router, "layer_number", None) is not None:
            generator = torch.Generator().manual_seed(1000 * step + router.layer_number)
            bias.add_((torch.rand(bias.shape, generator=generator) * BIAS_MOVE).to(bias.device))
            moved += 1
    return moved


def train_rank_with_perturbed_router(config: Any, prepared: Any) -> None:
    """`trainer._train_rank` with the routers' expert biases moved before each step's training."""
    from hf_mcore_bridge.grpo.run import trainer

    train_step = trainer._train_step
    steps = [0]

    def perturbed(policy: Any, config: Any, rollouts: Any, gate: Any = None) -> dict[str, float]:
        steps[0] += 1
        if not move_expert_biases(policy.policy.module, steps[0]):
            raise AssertionError("no router with an expert bias to move")
        return train_step(policy, config, rollouts, gate)

    trainer._train_step = perturbed
    trainer._train_rank(config, prepared)
