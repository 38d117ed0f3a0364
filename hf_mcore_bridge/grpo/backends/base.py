"""What the GRPO loop needs from the trained policy on one rank: one small protocol that both backends satisfy.

The trainer holds a `TrainingBackend` and does not ask which one it is: it computes log-probs, trains mini-batches,
streams HF-named weights into the engine, and saves and restores checkpoints through it, and splits rollouts over
its data-parallel ranks. The megatron-core backend (`backends.megatron.backend`) and the DTensor one
(`backends.dtensor.backend`) each forward to their policy module and carry what their checkpoints need; the run
builds the enabled one on every rank (`run.ranks.build_backend`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.refit.stream import PhaseTimes

__all__ = ["TrainingBackend", "checkpoint_assets"]


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

    def trained_names(self) -> list[str] | None:
        """The HF names of the tensors training changes, where that is not all of them (LoRA: the adapted
        projections, each refit after the first streams those alone); None: every tensor."""
        ...

    def adapter_weights(self, times: PhaseTimes | None = None) -> list[tuple[str, torch.Tensor]]:
        """Every LoRA adapter's A and B, whole, under PEFT's names without its prefix (`<HF module>.lora_A.weight`,
        `.lora_B.weight`), in one order on every rank, for an engine that applies them itself (`engine.lora`);
        empty without adapters. Collective: every rank calls it alike."""
        return []

    def hf_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole policy as (HF name, full tensor), on every rank (`names`: only those tensors, and fused
        neighbours). Collective: exhaust it everywhere. `times` collects the seconds of its `gather` and `transfer`
        phases. With LoRA adapters the adapted weights are merged (W + s B A) unless `merged` is False (the base
        weights, as the checkpoint holds them)."""
        ...

    def shard_local_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        """This rank's part of every HF tensor (or of `names`, as `hf_weights`; `merged` as there) from its own
        tensor-parallel shards, for an engine sharded over the trainer's TP group (`Engine.load_weights(...,
        parts=True)`); None where the backend cannot (then `hf_weights`). Collective where it returns a stream:
        exhaust it everywhere."""
        ...

    def refit_sources(self) -> list[torch.Tensor] | None:
        """The tensors `hf_weights` reads, where producing it takes no collective and the engine shares the
        trainer's GPU (the refit can then be recorded and replayed: `refit.replay`); else None."""
        ...

    def save_adapters(self, out_dir: Path, base_model: str) -> bool:
        """Where the policy trains adapters (LoRA), write them as a PEFT adapter directory at `out_dir` (on rank 0)
        and return True; else nothing and False. Collective: every rank calls it."""
        ...

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        """Write policy, optimizer and `trainer_state` for `step` under `root` (collective)."""
        ...

    def load_checkpoint(self, root: Path, step: int) -> dict[str, Any]:
        """Restore `root`'s checkpoint of `step`; returns the trainer state saved with it."""
        ...


def checkpoint_assets(hf_config: dict[str, Any], tokenizer_file: Path) -> dict[str, str]:
    """The HF files a checkpoint carries so that it exports without the source directory."""
    return {"config.json": json.dumps(hf_config, indent=2), "tokenizer.json": tokenizer_file.read_text()}
