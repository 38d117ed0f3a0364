"""The megatron-core policy behind the GRPO loop (`TrainingBackend`): log-probs and training steps of
`backends.megatron.policy`, its refit stream (`refit.stream`, through the mapping table) and megatron distributed
checkpoints (`backends.megatron.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig

if TYPE_CHECKING:
    from hf_mcore_bridge.grpo.backends.megatron.policy import Policy
    from hf_mcore_bridge.grpo.refit.stream import PhaseTimes

__all__ = ["MegatronBackend"]


@dataclass
class MegatronBackend:
    """The megatron-core policy (`backends.megatron.policy`), refit through the bridge API's stream, megatron
    checkpoints."""

    policy: Policy
    section: MegatronConfig
    """The run's `policy.megatron_cfg`."""
    layout: Layout
    """The run's layout (its plan's), written into checkpoints."""
    assets: dict[str, str]
    """The HF files every checkpoint carries (`checkpoint_assets`)."""

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
        """The bridge API's stream (`export_hf_weights`), which first completes DDP's deferred parameter all-gather
        on every rank (a stream read before it would hold stale shards)."""
        from hf_mcore_bridge.bridge import export

        return export.export_hf_weights([self.policy.model], self.policy.model_cfg, phases=times)

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

        save_checkpoint(self.policy, root, step, trainer_state, self._megatron_args(), self.assets)

    def load_checkpoint(self, root: Path, step: int) -> dict[str, Any]:
        from hf_mcore_bridge.grpo.backends.megatron.checkpoint import load_checkpoint

        return load_checkpoint(self.policy, root, step)

    def _megatron_args(self) -> Any:
        from hf_mcore_bridge.convert.config_bridge import megatron_args

        return megatron_args(
            self.policy.model_cfg,
            self.layout,
            self.policy.dtype,
            make_vocab_size_divisible_by=self.section.make_vocab_size_divisible_by,
            spec="te" if self.policy.model.config.transformer_impl == "transformer_engine" else "local",
        )
