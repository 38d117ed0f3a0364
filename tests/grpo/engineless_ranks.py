"""Rank functions that run the trainer's megatron-core side without a rollout engine (for architectures the engine
does not run yet): the policy built and loaded as a run builds it, the refit's weight stream, and one training step
on rollouts given by the test."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def train_step_rank(config: Any, prepared: Any, rollouts: list[Any], out: str) -> None:
    """`build_backend`, then the refit stream of the initial weights (`hf_weights`, full HF tensors gathered over
    TP and EP) and `trainer._train_step` on `rollouts`; rank 0 saves both."""
    from hf_mcore_bridge.grpo.backend import build_backend
    from hf_mcore_bridge.grpo.trainer import _train_step

    torch.manual_seed(config.grpo.seed)
    policy = build_backend(config, prepared)
    weights = {name: tensor.detach().cpu().clone() for name, tensor in policy.hf_weights()}
    metrics = _train_step(policy, config, rollouts)
    if dist.get_rank() == 0:
        torch.save({"metrics": metrics, "weights": weights}, Path(out))
