"""The training backend behind the GRPO loop: one small protocol that the megatron-core and DTensor policies satisfy.

The trainer holds a `TrainingBackend` and does not ask which one it is: it computes log-probs, trains mini-batches,
streams HF-named weights into the engine, and saves and restores checkpoints through it, and splits rollouts over
its data-parallel ranks. `build_backend` makes the enabled one on a rank; `start_world` starts the processes it
needs (megatron-core's `parallel_state` for its layout, or a bare world whose device mesh the DTensor policy lays
out). Each adapter below only forwards to its policy module (`grpo.policy` with `grpo.refit` and `grpo.checkpoint`,
or `grpo.dtensor_policy` with `grpo.dtensor_checkpoint`) and carries what their checkpoints need.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
from hf_mcore_bridge.grpo.run.config import GRPOConfig

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.backends.dtensor.policy import DTensorPolicy
    from hf_mcore_bridge.grpo.backends.megatron.policy import Policy
    from hf_mcore_bridge.grpo.refit.stream import PhaseTimes
    from hf_mcore_bridge.grpo.run.trainer import PreparedRun

__all__ = ["DTensorBackend", "MegatronBackend", "TrainingBackend", "build_backend", "start_world"]


class TrainingBackend(Protocol):
    """What the GRPO loop needs from the trained policy on one rank."""

    @property
    def dp_rank(self) -> int:
        """This rank's data-parallel index: it trains on every `dp_size`-th rollout from this one."""
        ...

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks (replicas or FSDP shards) the rollouts are split over."""
        ...

    @property
    def dp_group(self) -> Any:
        """Their process group (metrics are reduced over it)."""
        ...

    @property
    def tp_group(self) -> Any:
        """The trainer's tensor-parallel group of this rank (an engine of the same ranks shares it)."""
        ...

    @property
    def has_reference(self) -> bool:
        """Whether a frozen reference is kept for the KL term."""
        ...

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (restored on resume)."""
        ...

    def compute_logprobs(
        self, batches: list[MicroBatch], temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        """Per micro-batch, the sampled tokens' log-probs `[B, S-1]`, detached; `reference`: the initial weights."""
        ...

    def train_minibatch(
        self,
        batches: list[MicroBatch],
        old_logprobs: list[torch.Tensor] | None,
        ref_logprobs: list[torch.Tensor] | None,
        loss_config: LossConfig,
        temperature: float,
        before_step: Callable[[dict[str, float]], None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's micro-batches of a mini-batch; the mini-batch's metrics. `old_logprobs`
        None: the training forward's own, detached; `before_step` sees the metrics before the optimizer step."""
        ...

    def hf_names(self) -> list[str]:
        """The HF names `hf_weights` streams, in its order."""
        ...

    def hf_weights(self, times: PhaseTimes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole policy as (HF name, full tensor), on every rank. Collective: exhaust it everywhere.
        `times` collects the seconds of its `gather` and `transfer` phases."""
        ...

    def shard_local_weights(self, times: PhaseTimes | None = None) -> Iterator[tuple[str, torch.Tensor]] | None:
        """This rank's part of every HF tensor from its own tensor-parallel shards, for an engine sharded over the
        trainer's TP group (`Engine.load_weights(..., parts=True)`); None where the backend cannot (then
        `hf_weights`). Collective where it returns a stream: exhaust it everywhere."""
        ...

    def refit_sources(self) -> list[torch.Tensor] | None:
        """The tensors `hf_weights` reads, where producing it takes no collective and the engine shares the
        trainer's GPU (the refit can then be recorded and replayed: `refit_replay`); else None."""
        ...

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        """Write policy, optimizer and `trainer_state` for `step` under `root` (collective)."""
        ...

    def load_checkpoint(self, root: Path, step: int) -> dict[str, Any]:
        """Restore `root`'s checkpoint of `step`; returns the trainer state saved with it."""
        ...


def _assets(prepared: PreparedRun) -> dict[str, str]:
    """The HF files a checkpoint carries so that it exports without the source directory."""
    return {
        "config.json": json.dumps(prepared.hf_config, indent=2),
        "tokenizer.json": prepared.tokenizer_file.read_text(),
    }


@dataclass
class MegatronBackend:
    """The megatron-core policy (`grpo.policy`), refit through the mapping table, megatron checkpoints."""

    policy: Policy
    config: GRPOConfig
    prepared: PreparedRun

    @property
    def dp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def dp_size(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_world_size()

    @property
    def dp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @property
    def tp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_group()

    @property
    def has_reference(self) -> bool:
        return self.policy.reference is not None

    @property
    def optimizer_steps(self) -> int:
        return self.policy.optimizer_steps

    def compute_logprobs(
        self, batches: list[MicroBatch], temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        from hf_mcore_bridge.grpo.backends.megatron.policy import compute_logprobs

        return compute_logprobs(self.policy, batches, temperature, reference=reference)

    def train_minibatch(
        self,
        batches: list[MicroBatch],
        old_logprobs: list[torch.Tensor] | None,
        ref_logprobs: list[torch.Tensor] | None,
        loss_config: LossConfig,
        temperature: float,
        before_step: Callable[[dict[str, float]], None] | None = None,
    ) -> dict[str, float]:
        from hf_mcore_bridge.grpo.backends.megatron.policy import train_minibatch

        return train_minibatch(self.policy, batches, old_logprobs, ref_logprobs, loss_config, temperature, before_step)

    def hf_names(self) -> list[str]:
        from hf_mcore_bridge.convert.model_plan import placed_entries

        model_cfg = self.policy.model_cfg
        return [n for p in placed_entries(model_cfg) for n in p.hf_names()]

    def hf_weights(self, times: PhaseTimes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        from hf_mcore_bridge.grpo.refit.stream import finish_param_gather, hf_weights

        finish_param_gather(self.policy.model)  # now, on every rank: a deferred all-gather would leave stale shards
        return hf_weights(self.policy.module, self.policy.model_cfg, self.policy.padded_vocab, times)

    def shard_local_weights(self, times: PhaseTimes | None = None) -> Iterator[tuple[str, torch.Tensor]] | None:
        from hf_mcore_bridge.grpo.refit.stream import finish_param_gather, shard_local_hf_weights

        if self.policy.model_cfg.moe is not None:
            return None
        finish_param_gather(self.policy.model)
        return shard_local_hf_weights(self.policy.module, self.policy.model_cfg, self.policy.padded_vocab, times)

    def refit_sources(self) -> list[torch.Tensor] | None:
        import torch.distributed as dist

        if dist.get_world_size() > 1 or not torch.cuda.is_available():
            return None
        from hf_mcore_bridge.grpo.refit.stream import model_tensors

        return list(model_tensors(self.policy.module).values())

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        from hf_mcore_bridge.grpo.backends.megatron.checkpoint import save_checkpoint

        save_checkpoint(self.policy, root, step, trainer_state, self._megatron_args(), _assets(self.prepared))

    def load_checkpoint(self, root: Path, step: int) -> dict[str, Any]:
        from hf_mcore_bridge.grpo.backends.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self.policy, root, step)

    def _megatron_args(self) -> Any:
        from hf_mcore_bridge.convert.config_bridge import megatron_args
        from hf_mcore_bridge.grpo.backends.megatron.config import megatron_layout

        mcfg = self.config.policy.megatron_cfg
        return megatron_args(
            self.prepared.model_cfg,
            megatron_layout(mcfg),
            dtypes.FLAGS[self.config.policy.dtype].torch,
            make_vocab_size_divisible_by=mcfg.make_vocab_size_divisible_by,
            spec="te" if self.policy.model.config.transformer_impl == "transformer_engine" else "local",
        )


@dataclass
class DTensorBackend:
    """The HF model sharded with FSDP2 (`grpo.dtensor_policy`), names already HF, DCP checkpoints with an HF copy."""

    policy: DTensorPolicy
    assets: dict[str, str]

    @property
    def dp_rank(self) -> int:
        return self.policy.dp_rank

    @property
    def dp_size(self) -> int:
        return self.policy.dp_size

    @property
    def dp_group(self) -> Any:
        return self.policy.dp_group

    @property
    def tp_group(self) -> Any:
        return self.policy.mesh["tp"].get_group()

    @property
    def has_reference(self) -> bool:
        return self.policy.reference is not None

    @property
    def optimizer_steps(self) -> int:
        return self.policy.optimizer_steps

    def compute_logprobs(
        self, batches: list[MicroBatch], temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        return self.policy.compute_logprobs(batches, temperature, reference=reference)

    def train_minibatch(
        self,
        batches: list[MicroBatch],
        old_logprobs: list[torch.Tensor] | None,
        ref_logprobs: list[torch.Tensor] | None,
        loss_config: LossConfig,
        temperature: float,
        before_step: Callable[[dict[str, float]], None] | None = None,
    ) -> dict[str, float]:
        return self.policy.train_minibatch(batches, old_logprobs, ref_logprobs, loss_config, temperature, before_step)

    def hf_names(self) -> list[str]:
        return [name for name, _, _ in self.policy.hf_specs()]

    def hf_weights(self, times: PhaseTimes | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        return self.policy.hf_weights(times)

    def shard_local_weights(self, times: PhaseTimes | None = None) -> Iterator[tuple[str, torch.Tensor]] | None:
        return None  # FSDP2 shards are not the engine's tensor-parallel parts: `hf_weights` makes full tensors

    def refit_sources(self) -> list[torch.Tensor] | None:
        return None  # FSDP2's full_tensor() is a collective, and its unsharded copies are fresh each time

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import save_dtensor_checkpoint

        save_dtensor_checkpoint(self.policy, root, step, trainer_state, self.assets)

    def load_checkpoint(self, root: Path, step: int) -> dict[str, Any]:
        from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import load_dtensor_checkpoint

        return load_dtensor_checkpoint(self.policy, root, step)


def build_backend(config: GRPOConfig, prepared: PreparedRun) -> TrainingBackend:
    """This rank's policy of the enabled backend, loaded from `prepared.checkpoint_dir` (collective)."""
    dtype = dtypes.FLAGS[config.policy.dtype].torch
    total_steps = config.grpo.max_num_steps * config.grpo.num_minibatches
    keep_reference = config.loss_fn.kl_coef > 0
    if config.policy.dtensor_cfg.enabled:
        from hf_mcore_bridge.grpo.backends.dtensor.policy import build_dtensor_policy

        policy = build_dtensor_policy(
            prepared.checkpoint_dir, config.policy.dtensor_cfg, dtype, total_steps, keep_reference
        )
        return DTensorBackend(policy, _assets(prepared))
    from hf_mcore_bridge.grpo.backends.megatron.config import megatron_layout
    from hf_mcore_bridge.grpo.backends.megatron.policy import build_policy
    from hf_mcore_bridge.megatron.cpu_patches import apply_cpu_training_workarounds

    apply_cpu_training_workarounds()
    megatron = build_policy(
        prepared.model_cfg,
        config.policy.megatron_cfg,
        megatron_layout(config.policy.megatron_cfg),
        dtype,
        prepared.padded_vocab,
        prepared.checkpoint_dir,
        total_optimizer_steps=total_steps,
        keep_reference=keep_reference,
    )
    return MegatronBackend(megatron, config, prepared)


def start_world(config: GRPOConfig, fn: Callable[..., None], *args: Any) -> None:
    """Run `fn(*args)` on every rank of a world of the enabled backend (`parallel_dims(config).world` ranks):
    spawned here, or the launcher's (torchrun) world this process is a rank of (see `world`)."""
    from hf_mcore_bridge.grpo.run.plan import parallel_dims
    from hf_mcore_bridge.megatron.world import run_torch_world, run_world

    dims = parallel_dims(config)
    if config.policy.dtensor_cfg.enabled:
        run_torch_world(fn, dims.world, *args)
        return
    run_world(fn, dims.layout, *args, world=dims.world)
