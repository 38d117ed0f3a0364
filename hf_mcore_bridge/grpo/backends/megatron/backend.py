"""The megatron-core policy behind the GRPO loop (`TrainingBackend`): log-probs and training steps of
`backends.megatron.policy`, its refit stream (`refit.stream`, through the mapping table) and megatron distributed
checkpoints (`backends.megatron.checkpoint`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig
from hf_mcore_bridge.grpo.backends.megatron.config import MegatronConfig
from hf_mcore_bridge.megatron.lora_config import LoraConfig

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
    lora: LoraConfig | None = None
    """The run's `policy.lora` when enabled (the adapters' rank, alpha and targets, for `save_adapters`)."""

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

    def trained_names(self) -> list[str] | None:
        """With LoRA, the HF weights of the adapted linears (every HF tensor of their table entries, each adapted
        expert's among them); else None. Collective over the pipeline stages and the expert-parallel group: each
        holds its own layers' (experts') adapters, and the stream that follows is collective, so every rank must
        name the same tensors."""
        from hf_mcore_bridge.megatron.lora import adapted_weights

        adapted = adapted_weights(self.policy.module)
        if not adapted:
            return None
        return [name for name in self.hf_names() if name in adapted]

    def adapter_weights(self, times: PhaseTimes | None = None) -> list[tuple[str, torch.Tensor]]:
        """The adapters gathered whole over TP (`full_adapters`), then every pipeline stage's sent to every rank of
        the pipeline group (`_all_stages`); experts' adapters are not streamed so (the engine does not apply them)."""
        from contextlib import nullcontext

        from hf_mcore_bridge.grpo.refit.stream import finish_param_gather
        from hf_mcore_bridge.megatron.lora import adapter_modules, full_adapters

        adapters = adapter_modules(self.policy.module)
        if not adapters:
            return []
        if any(holder.expert for holder in adapters):
            raise BridgeError("LoRA adapters on experts are streamed merged (the engine applies dense ones only)")
        finish_param_gather(self.policy.model)  # the distributed optimizer's deferred all-gather of the adapters
        with times.phase("gather") if times is not None else nullcontext():
            mine = full_adapters(adapters)
        with times.phase("transfer") if times is not None else nullcontext():
            every = _all_stages(mine, adapters[0].lora_a[0].device)
        return [
            (f"{module}{suffix}", tensor)
            for module, pair in every.items()
            for suffix, tensor in zip((".lora_A.weight", ".lora_B.weight"), pair, strict=True)
        ]

    def hf_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The bridge API's stream (`export_hf_weights`), which first completes DDP's deferred parameter all-gather
        on every rank (a stream read before it would hold stale shards); with LoRA adapters, of the merged
        weights (`_merged`), the adapters' own deferred all-gather completed before they are merged."""
        from hf_mcore_bridge.bridge import export
        from hf_mcore_bridge.grpo.refit.stream import finish_param_gather
        from hf_mcore_bridge.megatron.lora import adapter_modules

        model, model_cfg = self.policy.model, self.policy.model_cfg
        if adapter_modules(self.policy.module):  # collective; before the merge, not in the lazy stream
            finish_param_gather(model)
        stream = export.export_hf_weights([model], model_cfg, phases=times, names=names)
        return _merged(self.policy.module, stream) if merged else stream

    def shard_local_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]] | None:
        from hf_mcore_bridge.grpo.refit.stream import finish_param_gather, shard_local_hf_weights

        if self.policy.model_cfg.moe is not None:
            return None
        finish_param_gather(self.policy.model)
        module = self.policy.module
        stream = shard_local_hf_weights(module, self.policy.model_cfg, self.policy.padded_vocab, times, names)
        return _merged(module, stream) if merged else stream

    def refit_sources(self) -> list[torch.Tensor] | None:
        import torch.distributed as dist

        from hf_mcore_bridge.megatron.lora import adapter_modules

        # the merged weights a LoRA refit streams exist only while it streams: no sources to replay from
        if dist.get_world_size() > 1 or not torch.cuda.is_available() or adapter_modules(self.policy.module):
            return None
        from hf_mcore_bridge.grpo.refit.stream import model_tensors

        return list(model_tensors(self.policy.module).values())

    def save_adapters(self, out_dir: Path, base_model: str) -> bool:
        """The adapters gathered whole (over TP, then the pipeline stages' layers) and written by global rank 0 as a
        PEFT directory (`megatron.lora_peft`); False without adapters."""
        import torch.distributed as dist
        from megatron.core import parallel_state

        from hf_mcore_bridge.megatron.lora import adapter_modules, full_adapters
        from hf_mcore_bridge.megatron.lora_peft import write_peft_adapter

        adapters = adapter_modules(self.policy.module)
        if self.lora is None or not adapters:
            return False
        mine = {name: (a.cpu(), b.cpu()) for name, (a, b) in full_adapters(adapters).items()}
        stages: list[Any] = [None] * parallel_state.get_pipeline_model_parallel_world_size()
        dist.all_gather_object(stages, mine, group=parallel_state.get_pipeline_model_parallel_group())
        if dist.get_rank() == 0:
            write_peft_adapter({k: v for stage in stages for k, v in stage.items()}, self.lora, out_dir, base_model)
        return True

    def save_checkpoint(self, root: Path, step: int, trainer_state: dict[str, Any]) -> None:
        from hf_mcore_bridge.grpo.backends.megatron.checkpoint import save_checkpoint

        save_checkpoint(self.policy, root, step, trainer_state, self._megatron_args(), self.assets, self.lora)

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


def _all_stages(
    mine: dict[str, tuple[torch.Tensor, torch.Tensor]], device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Every pipeline stage's adapters (`mine`: this stage's, whole) on every rank of the pipeline group, stage by
    stage: names, shapes and dtype as objects, then each stage's tensors flattened into one buffer on `device` and
    broadcast from that stage's rank (no host copy of the tensors). Collective over the pipeline group."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if stages == 1:
        return mine
    group = parallel_state.get_pipeline_model_parallel_group()
    dtype = next(iter(mine.values()))[0].dtype if mine else None
    layouts: list[Any] = [None] * stages
    layout = [(name, tuple(a.shape), tuple(b.shape)) for name, (a, b) in mine.items()]
    dist.all_gather_object(layouts, (dtype, layout), group=group)
    every: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for stage, (stage_dtype, entries) in enumerate(layouts):
        if not entries:
            continue
        sizes = [math.prod(shape) for _, *shapes in entries for shape in shapes]
        if stage == parallel_state.get_pipeline_model_parallel_rank():
            flat = torch.cat([t.reshape(-1) for pair in mine.values() for t in pair])
        else:
            flat = torch.empty(sum(sizes), dtype=stage_dtype, device=device)
        dist.broadcast(flat, dist.get_global_rank(group, stage), group=group)
        pieces = iter(flat.split(sizes))
        for name, shape_a, shape_b in entries:
            every[name] = (next(pieces).view(shape_a), next(pieces).view(shape_b))
    return every


def _merged(module: torch.nn.Module, stream: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`stream` read while the adapted weights of `module` hold W + s B A (`megatron.lora.merged`, put back exactly
    once the stream ends or is dropped); the stream itself where the model has no adapters. A streamed tensor that
    shares an adapted weight's storage (a TP1 column-parallel view) is copied: a bucketed refit may load it after
    the stream, hence the merge, has ended."""
    from hf_mcore_bridge.megatron.lora import adapter_modules, merged

    if not adapter_modules(module):
        yield from stream
        return
    adapted = {m.weight.untyped_storage().data_ptr() for m in module.modules() if hasattr(m, "lora")}
    with merged(module):
        for name, tensor in stream:
            shared = tensor.untyped_storage().data_ptr() in adapted
            yield name, tensor.clone() if shared else tensor
