"""Rank function of `test_fused_logprobs`: one GRPO step through `trainer._train_step`, with the old log-probs
taken from a separate forward pass and from the training forward, on policies loaded from one checkpoint."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hf_mcore_bridge.grpo.algorithm.batching import Rollout
from hf_mcore_bridge.grpo.refit.logprob_gate import LogprobMismatchError
from hf_mcore_bridge.grpo.run import trainer
from hf_mcore_bridge.grpo.run.config import GRPOConfig
from hf_mcore_bridge.grpo.run.ranks import build_backend


def _full(tensor: torch.Tensor) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)  # DTensor parameters (FSDP2)
    return (full() if full is not None else tensor).detach().clone()


def _module(backend: Any) -> torch.nn.Module:
    policy = backend.policy
    return policy.module if hasattr(policy, "padded_vocab") else policy.model


def one_step(config: GRPOConfig, prepared: Any, rollouts: list[Rollout], gate: Any = None) -> dict[str, Any]:
    """A fresh policy from `prepared`, one `_train_step`; its metrics, the values the gate saw, the number of
    forward passes of the model, the weights after the step and whether the gate stopped it."""
    backend = build_backend(config, prepared)
    module = _module(backend)
    forwards = [0]
    module.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    gated: list[float] = []

    def record(value: float) -> None:
        gated.append(value)
        if gate is not None:
            gate(value)

    before = [_full(p) for p in module.parameters()]
    try:
        metrics, stopped = trainer._train_step(backend, config, rollouts, gate=record), False
    except LogprobMismatchError:
        metrics, stopped = {}, True
    after = [_full(p) for p in module.parameters()]
    return {
        "metrics": metrics,
        "gated": gated,
        "forwards": forwards[0],
        "stopped": stopped,
        "weights": after,
        "unchanged": all(torch.equal(a, b) for a, b in zip(before, after, strict=True)),
    }


def fused_step_rank(configs: dict[str, GRPOConfig], prepared: Any, rollouts: list[Rollout], out: str) -> None:
    """Each named config's step from the same initial weights; `refuse` also gets a gate that raises."""

    def refuse(value: float) -> None:
        raise LogprobMismatchError(f"refused {value}")

    results = {
        name: one_step(config, prepared, rollouts, refuse if name.startswith("refuse") else None)
        for name, config in configs.items()
    }
    if dist.get_rank() == 0:
        torch.save(results, out)
