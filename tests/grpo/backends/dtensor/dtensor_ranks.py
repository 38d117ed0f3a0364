"""Rank functions the DTensor tests run inside `hf_mcore_bridge.megatron.world.run_torch_world` (gloo on CPU)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from hf_mcore_bridge.grpo.algorithm.batching import Rollout, make_microbatches, pack_microbatches
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
from hf_mcore_bridge.grpo.backends.dtensor.policy import build_dtensor_policy


def logprobs_and_step_rank(
    hf_dir: str,
    settings: DTensorConfig,
    rollouts: list[Rollout],
    micro_batch_size: int,
    loss_config: LossConfig,
    temperature: float,
    out: str,
) -> None:
    """Log-probs of all `rollouts` (padded and packed micro-batches, rebuilt the same way by the test), then one
    `train_minibatch` on this data-parallel rank's share (every dp-th rollout, as the trainer splits; packed rows
    when `settings.sequence_packing`); rank 0 saves
    the log-probs, the step's metrics and the full updated weights (tensors and floats only). After the step the
    log-probs are taken again, of the updated policy and of the KL reference (the initial weights swapped in)."""
    policy = build_dtensor_policy(Path(hf_dir), settings, torch.float32, total_optimizer_steps=1, keep_reference=True)
    padded = make_microbatches(rollouts, micro_batch_size)
    packed = pack_microbatches(rollouts, max_tokens=64)
    results = {
        "padded": policy.compute_logprobs(padded, temperature),
        "packed": policy.compute_logprobs(packed, temperature),
    }
    share = rollouts[policy.dp_rank :: policy.dp_size]
    mine = pack_microbatches(share, 32) if settings.sequence_packing else make_microbatches(share, micro_batch_size)
    old = policy.compute_logprobs(mine, temperature)
    ref = policy.compute_logprobs(mine, temperature, reference=True)
    metrics = policy.train_minibatch(mine, old, ref, loss_config, temperature)
    results["padded_after_step"] = policy.compute_logprobs(padded, temperature)
    results["padded_reference_after_step"] = policy.compute_logprobs(padded, temperature, reference=True)
    weights = {name: tensor.cpu() for name, tensor in policy.hf_weights()}
    if dist.get_rank() == 0:
        torch.save({**results, "metrics": metrics, "weights": weights}, out)
