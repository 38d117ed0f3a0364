"""The DTensor policy behind the GRPO loop (`TrainingBackend`): the HF model sharded with FSDP2
(`backends.dtensor.policy`), its weights already HF-named, DCP checkpoints with an HF copy, or with LoRA the
adapters as a PEFT directory (`backends.dtensor.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.backends.dtensor.policy import DTensorPolicy
    from hf_mcore_bridge.grpo.refit.stream import PhaseTimes

__all__ = ["DTensorBackend"]


@dataclass
class DTensorBackend:
    """The HF model sharded with FSDP2 (`backends.dtensor.policy`), names already HF, DCP checkpoints with an HF
    copy."""

    policy: DTensorPolicy
    assets: dict[str, str]
    base_model: str | None = None
    """The run's `policy.model_path`: a LoRA checkpoint's adapters name it as their base (its weights are not
    stored again)."""

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

    def trained_names(self) -> list[str] | None:
        return self.policy.adapted_names() or None  # LoRA: the adapted projections; else every tensor changes

    def hf_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return self.policy.hf_weights(times, names, merged)  # the same selection on every rank: collective alike

    def shard_local_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        return None  # FSDP2 shards are not the engine's tensor-parallel parts: `hf_weights` makes full tensors

    def save_adapters(self, out_dir: Path, base_model: str) -> bool:
        """With LoRA, the adapters gathered whole and written by rank 0 as a PEFT directory; False without."""
        if self.policy.lora is None:
            return False
        import torch.distributed as dist

        from hf_mcore_bridge.grpo.backends.dtensor.lora import full_adapters
        from hf_mcore_bridge.megatron.lora_peft import write_peft_adapter

        values = {name: (a.cpu(), b.cpu()) for name, (a, b) in full_adapters(self.policy.model)}
        if dist.get_rank() == 0:
            write_peft_adapter(values, self.policy.lora, out_dir, base_model)
        return True

    def refit_sources(self) -> list[torch.Tensor] | None:
        return None  # FSDP2's full_tensor() is a collective, and its unsharded copies are fresh each time

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import save_dtensor_checkpoint

        save_dtensor_checkpoint(self.policy, root, step, trainer_state, self.assets, self.base_model)

    def load_checkpoint(self, root: Path, step: int) -> dict[str, Any]:
        from hf_mcore_bridge.grpo.backends.dtensor.checkpoint import load_dtensor_checkpoint

        return load_dtensor_checkpoint(self.policy, root, step)
