"""Rank functions that run the trainer's megatron-core side without a rollout engine (for architectures the engine
does not run yet, or layouts checked without generating): the policy built and loaded as a run builds it, the
refit's weight stream, and one training step on rollouts given by the test, with its log-probs and the gradients
the optimizer receives."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def train_step_rank(config: Any, prepared: Any, rollouts: list[Any], out: str) -> None:
    """`build_backend`, then the refit stream of the initial weights (`hf_weights`, full HF tensors gathered over
    TP and EP) and `trainer._train_step` on `rollouts`; rank 0 saves both."""
    from hf_mcore_bridge.grpo.run.ranks import build_backend
    from hf_mcore_bridge.grpo.run.trainer import _train_step

    torch.manual_seed(config.grpo.seed)
    policy = build_backend(config, prepared)
    weights = {name: tensor.detach().cpu().clone() for name, tensor in policy.hf_weights()}
    metrics = _train_step(policy, config, rollouts)
    if dist.get_rank() == 0:
        torch.save({"metrics": metrics, "weights": weights}, Path(out))


def logprobs_and_gradients_rank(configs: list[Any], prepared: Any, rollouts: list[Any], out: str) -> None:
    """For each config (the same layout and model, one backend built after the other): `build_backend`, this
    data-parallel rank's completion log-probs (`compute_logprobs` on the micro-batches `_train_step` makes), then
    `_train_step` on `rollouts`, whose gradients are taken as the optimizer receives them (reduced over data x
    context ranks, before clipping) and streamed under their HF names by the refit's mapping (`hf_weights` of the
    gradients put in place of the weights). Every rank saves `<out>/rank<r>.pt`: per config,
    its data-parallel and context-parallel ranks, `logprobs` (`(tokens, completion log-probs)` per rollout, in the
    order of the micro-batches), `metrics` and `grads`."""
    from megatron.core import parallel_state

    from hf_mcore_bridge.grpo.run.ranks import build_backend
    from hf_mcore_bridge.grpo.run.trainer import _minibatches

    results = []
    for config in configs:
        torch.manual_seed(config.grpo.seed)
        backend = build_backend(config, prepared)
        flat = [b for mini in _minibatches(backend, config, rollouts) for b in mini]
        logprobs = backend.compute_logprobs(flat, config.generation.temperature)
        completion = [seq for lp, b in zip(logprobs, flat, strict=True) for seq in _by_sequence(lp, b)]
        metrics, grads = _step_gradients(backend, config, rollouts)
        results.append(
            {
                "dp_rank": parallel_state.get_data_parallel_rank(),
                "cp_rank": parallel_state.get_context_parallel_rank(),
                "logprobs": completion,
                "metrics": metrics,
                "grads": grads,
            }
        )
    torch.save(results, Path(out) / f"rank{dist.get_rank()}.pt")


def layouts_rank(runs: list[tuple[Any, Any]], rollouts: list[Any], out: str) -> None:
    """For each `(config, prepared)` of `runs` (one model; layouts of the same number of ranks), in one world:
    megatron-core's `parallel_state` set up for the run's layout (`prepared.plan.dims.layout`), `build_backend`,
    the refit stream of the initial weights and `_train_step` on `rollouts` with the gradients the optimizer
    receives (as `logprobs_and_gradients_rank` takes them). Rank 0 saves, per run, `weights`, `metrics` and `grads`
    (under HF names, gathered over TP and EP) as `<out>`."""
    from megatron.core import parallel_state

    from hf_mcore_bridge.grpo.run.ranks import build_backend
    from hf_mcore_bridge.megatron.world import initialize_parallel_state

    results = []
    for config, prepared in runs:
        layout = prepared.plan.dims.layout
        parallel_state.destroy_model_parallel()
        initialize_parallel_state(layout)
        torch.manual_seed(config.grpo.seed)
        backend = build_backend(config, prepared)
        weights = {name: tensor.detach().cpu().clone() for name, tensor in backend.hf_weights()}
        metrics, grads = _step_gradients(backend, config, rollouts)
        results.append({"weights": weights, "metrics": metrics, "grads": grads})
    if dist.get_rank() == 0:
        torch.save(results, Path(out))


def _step_gradients(backend: Any, config: Any, rollouts: list[Any]) -> tuple[dict, dict[str, torch.Tensor]]:
    """`_train_step` on `rollouts`: its metrics, and the gradients the optimizer receives (`main_grad`, after
    megatron-core's `finalize_model_grads`: reduced over data x context ranks, sequence-parallel and q/k norms
    summed over TP; before clipping) under their HF names, streamed by the refit's mapping (`hf_weights` of the
    gradients put in place of the weights, which the step leaves there)."""
    from hf_mcore_bridge.grpo.run.trainer import _train_step

    module, optimizer = backend.policy.module, backend.policy.optimizer
    grads: list[torch.Tensor] = []
    step = optimizer.step

    def step_after_snapshot() -> Any:
        grads.extend(param.main_grad.detach().clone() for param in module.parameters())
        return step()

    optimizer.step = step_after_snapshot
    metrics = _train_step(backend, config, rollouts)
    with torch.no_grad():
        for param, grad in zip(module.parameters(), grads, strict=True):
            param.copy_(grad)
    return metrics, {name: tensor.detach().cpu().clone() for name, tensor in backend.hf_weights()}


def _by_sequence(logprobs: torch.Tensor, batch: Any) -> list[tuple[list[int], torch.Tensor]]:
    """Each rollout of `batch` as its tokens (prompt and completion) and the log-probs `[C]` of its completion, from
    the micro-batch's `logprobs` `[B, S-1]`: padded rows end after their last completion token, packed rows are cut
    at `cu_seqlens`."""
    out = []
    for row in range(batch.num_rows):
        if batch.cu_seqlens is None:
            bounds = [(0, int(batch.mask[row].nonzero().max()) + 2)]
        else:
            bounds = list(itertools.pairwise(batch.cu_seqlens.tolist()))
        for start, stop in bounds:
            mask = batch.mask[row, start : stop - 1].bool()
            out.append((batch.tokens[row, start:stop].tolist(), logprobs[row, start : stop - 1][mask]))
    return out
