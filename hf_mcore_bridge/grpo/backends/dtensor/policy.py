"""The DTensor side of GRPO on one rank: the HF transformers policy sharded with FSDP2, its optimizer and steps.

The counterpart of `grpo.backends.megatron.policy` (megatron-core) with the same roles: log-probs of sampled tokens, one
optimizer step per mini-batch, and the weights as `(hf_name, full tensor)` for the engine. Runs inside a world of
`dp_shard * tp` ranks (process group initialised, no megatron-core state); the model is an `AutoModelForCausalLM` read
from an HF directory (safetensors only) and sharded by `backends.dtensor.parallel`.

- Precision: the parameters are the fp32 master weights; with `bf16` FSDP2 computes in bf16 and reduces
  gradients in fp32, and the refit stream is cast to bf16 (what the forward pass computes with). `fp16` is not
  offered (it would need a gradient scaler).
- Log-probs: `log_softmax(logits / temperature)` of the sampled token over the model's whole vocabulary, which is
  the real one (HF configs carry no Megatron padding), as the engine computes them.
- Micro-batches come from `grpo.algorithm.batching`. Padded rows get the plain causal mask (right padding is invisible
  to earlier positions). Packed rows are given only their `position_ids`, restarting at 0 per rollout, and no attention
  mask: transformers' masking utilities (`find_packed_sequence_indices`) then build the block-diagonal causal mask,
  provided no KV cache is passed (`use_cache=False`).
- Loss: `grpo.algorithm.losses.grpo_loss` per micro-batch, normalised by the mini-batch's count summed over the
  data-parallel ranks; FSDP2 averages gradients over them, so each loss is multiplied by their number. Gradients
  are reduce-scattered after every micro-batch (FSDP2's default, bounded memory), or once per mini-batch with
  `defer_gradient_sync` (`set_requires_gradient_sync` on the last micro-batch only).
- Optimizer: torch AdamW (its fused kernel on CUDA) on the sharded parameters, weight decay on matrices only
  (megatron-core's default grouping), global-norm clipping over DTensors, megatron-core's LR schedule
  (`grpo.backends.dtensor.lr_schedule`).

- LoRA (`policy.lora`): PEFT's LoRA layers injected before sharding (`backends.dtensor.lora`), the base frozen and
  the adapters alone in the optimizer; the HF-named stream holds the adapted weights merged (W + (B A) * scale).
- Mixture-of-experts models: the stream names routed experts as the checkpoint does, one expert's tensors at a time
  (`backends.dtensor.experts`), though transformers 5 holds them fused.

Simplifications: every rank reads the whole safetensors checkpoint before sharding it (host memory for one full
copy per rank while loading; a meta-device build with a broadcast from rank 0 would avoid it); the KL reference is
a copy of this rank's initial shards swapped in for a forward pass, as the megatron side does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from hf_mcore_bridge.grpo.algorithm.batching import MicroBatch
from hf_mcore_bridge.grpo.algorithm.losses import LossConfig, global_valid_count, grpo_loss
from hf_mcore_bridge.grpo.backends.dtensor.config import DTensorConfig
from hf_mcore_bridge.grpo.backends.dtensor.lr_schedule import lr_scheduler
from hf_mcore_bridge.grpo.backends.dtensor.parallel import (
    clip_grad_norm,
    hf_state_entries,
    make_mesh,
    parallelize_hf_model,
)
from hf_mcore_bridge.grpo.refit.stream import PhaseTimes
from hf_mcore_bridge.megatron.lora_config import LoraConfig
from hf_mcore_bridge.megatron.lora_dropout import dropout_rng

__all__ = ["DTensorPolicy", "build_dtensor_policy", "hf_policy_dir", "load_hf_model", "token_logprobs"]


def hf_policy_dir(model_path: Path, log_dir: Path) -> Path:
    """The HF directory the policy starts from: `model_path` itself, or a Megatron checkpoint exported to HF into
    `log_dir/initial_policy_hf` (parent process, before any rank starts)."""
    from hf_mcore_bridge.convert.to_hf import convert_mcore_to_hf

    if (model_path / "config.json").exists() and any(model_path.glob("*.safetensors")):
        return model_path
    destination = log_dir / "initial_policy_hf"
    convert_mcore_to_hf(model_path, destination, overwrite=True, show_progress=False)
    return destination


def load_hf_model(hf_dir: Path) -> torch.nn.Module:
    """The HF causal LM of `hf_dir` in fp32 (the master weights), from safetensors only, with SDPA attention."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        hf_dir, dtype=torch.float32, attn_implementation="sdpa", use_safetensors=True
    )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """Log-probs `[B, S-1]` of `tokens[:, 1:]` under `log_softmax(logits[:, :-1] / temperature)`, in fp32.

    logits: [B, S, V] over the whole vocabulary; tokens: [B, S].
    """
    scaled = logits[:, :-1].float() / temperature
    targets = tokens[:, 1:]
    return -F.cross_entropy(scaled.flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)


def _no_decay(name: str, param: torch.nn.Parameter) -> bool:
    """megatron-core's default: no weight decay on biases and 1-D parameters (norms)."""
    return name.endswith(".bias") or param.dim() == 1


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if not _no_decay(n, p)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if _no_decay(n, p)], "weight_decay": 0.0},
    ]


@dataclass
class DTensorPolicy:
    """The sharded model on this rank and what steps it."""

    model: torch.nn.Module
    """The HF causal LM, sharded in place (`FSDPModule`)."""
    optimizer: torch.optim.Optimizer
    """AdamW over the sharded fp32 parameters."""
    scheduler: torch.optim.lr_scheduler.LRScheduler
    """Stepped once per optimizer step."""
    mesh: DeviceMesh
    """The ("dp_shard", "tp") mesh."""
    settings: DTensorConfig
    dtype: torch.dtype
    """Compute dtype (the engine's)."""
    reference: list[torch.Tensor] | None = None
    """This rank's initial parameter shards (the KL reference), or None when no KL term is used."""
    optimizer_steps: int = field(default=0)
    lora: LoraConfig | None = None
    """The run's `policy.lora` when enabled (PEFT's LoRA layers in `model`)."""

    @property
    def device(self) -> torch.device:
        from hf_mcore_bridge.megatron.world import device

        return device()

    @property
    def dp_group(self) -> dist.ProcessGroup:
        return self.mesh["dp_shard"].get_group()

    @property
    def dp_size(self) -> int:
        return self.mesh["dp_shard"].size()

    @property
    def dp_rank(self) -> int:
        return self.mesh["dp_shard"].get_local_rank()

    def _logits(self, batch: MicroBatch) -> torch.Tensor:
        # No attention mask: padded rows are plainly causal, packed rows get theirs from the restarting positions.
        return self.model(input_ids=batch.tokens, position_ids=batch.position_ids, use_cache=False).logits

    def compute_logprobs(
        self, batches: list[MicroBatch], temperature: float, reference: bool = False
    ) -> list[torch.Tensor]:
        """Per micro-batch, the log-probs `[B, S-1]` (detached, on the CPU); `reference=True` uses the initial
        weights."""
        self.model.eval()
        try:
            with torch.no_grad(), _SwappedIn(self.model, self.reference if reference else None):
                out = []
                for batch in batches:
                    batch = batch.to(self.device)
                    out.append(token_logprobs(self._logits(batch), batch.tokens, temperature).cpu())
                # The root stays unsharded after a forward (reshard_after_forward=False) and no backward follows
                # to reshard it; until it is, its registered parameters are the gathered plain tensors, not the
                # DTensor shards that the reference swap and the optimizer write to.
                self.model.reshard()
        finally:
            self.model.train()
        return out

    def train_minibatch(
        self,
        batches: list[MicroBatch],
        old_logprobs: list[torch.Tensor] | None,
        ref_logprobs: list[torch.Tensor] | None,
        loss_config: LossConfig,
        temperature: float,
        before_step: Callable[[dict[str, float]], None] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on this rank's `batches` of the mini-batch: forward/backward per micro-batch, clip,
        AdamW, scheduler. Returns token-weighted metrics over every data-parallel rank plus `grad_norm` and `lr`.
        `old_logprobs` None: each forward's own, detached; `before_step` sees the metrics before the step."""
        batches = [b.to(self.device) for b in batches]
        group = self.dp_group if self.dp_size > 1 else None
        global_count = global_valid_count([b.mask for b in batches], loss_config.aggregation, group)
        self.optimizer.zero_grad(set_to_none=True)
        with dropout_rng(self.lora, self.optimizer_steps, self.dp_rank):  # LoRA dropout: masks seeded per step
            results = self._forward_backward(
                batches, old_logprobs, ref_logprobs, loss_config, temperature, global_count
            )
        metrics = _weighted_means(self._over_data_parallel(results))
        if before_step is not None:
            before_step(metrics)
        clip = self.settings.clip_grad if self.settings.clip_grad > 0 else math.inf
        grad_norm = clip_grad_norm(self.model.parameters(), clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer_steps += 1
        return metrics | {"grad_norm": float(grad_norm), "lr": float(lr)}

    def _forward_backward(
        self,
        batches: list[MicroBatch],
        old_logprobs: list[torch.Tensor] | None,
        ref_logprobs: list[torch.Tensor] | None,
        loss_config: LossConfig,
        temperature: float,
        global_count: torch.Tensor,
    ) -> list[dict[str, float]]:
        """Forward and backward of each micro-batch (training mode); their metrics."""
        results = []
        for index, batch in enumerate(batches):
            if self.settings.defer_gradient_sync:  # reduce-scatter once, after the last micro-batch
                self.model.set_requires_gradient_sync(index == len(batches) - 1)
            logprobs = token_logprobs(self._logits(batch), batch.tokens, temperature)
            loss, metrics = grpo_loss(
                logprobs,
                None if old_logprobs is None else old_logprobs[index].to(self.device),
                batch.advantages,
                batch.mask,
                global_count,
                loss_config,
                ref_logprobs=None if ref_logprobs is None else ref_logprobs[index].to(self.device),
                engine_logprobs=batch.engine_logprobs,
            )
            (loss * self.dp_size).backward()
            results.append({k: float(v) for k, v in metrics.items()})
        return results

    def _over_data_parallel(self, results: list[dict[str, float]]) -> list[dict[str, float]]:
        if self.dp_size == 1:
            return results
        everyone: list[list[dict[str, float]]] = [[] for _ in range(self.dp_size)]
        dist.all_gather_object(everyone, results, group=self.dp_group)
        return [r for replica in everyone for r in replica]

    def hf_weights(
        self, times: PhaseTimes | None = None, names: Collection[str] | None = None, merged: bool = True
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The whole model (or the tensors of `names`) as (HF name, full tensor in the compute dtype), on every rank;
        tied weights once; routed experts under the checkpoint's per-expert names (`backends.dtensor.experts`);
        with LoRA the adapted weights merged, unless `merged` is False (the base weights).

        Collective: every rank must exhaust it (only the entries with a wanted name are gathered, the same on every
        rank). `times` collects the all-gathers' seconds (`gather`)."""
        from hf_mcore_bridge.grpo.backends.dtensor.experts import split

        times = times or PhaseTimes()
        adapters = self._adapters() if merged else {}
        pieces = self._expert_pieces()
        for name, value in self._entries():
            cut = pieces.get(name)
            if names is not None and not any(n in names for n in ([p.name for p in cut] if cut else [name])):
                continue
            with times.phase("gather"):  # one DTensor all-gathered (and its adapter's factors)
                full = value.full_tensor() if isinstance(value, DTensor) else value
                module = adapters.get(name)
                if module is not None:
                    from hf_mcore_bridge.grpo.backends.dtensor.lora import merged_weight

                    full = merged_weight(full, module)
            for part_name, tensor in split(full, cut) if cut else [(name, full)]:
                if names is None or part_name in names:
                    yield part_name, tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def _entries(self) -> list[tuple[str, torch.Tensor]]:
        """The state dict's (HF in-memory name, value), tied tensors once; with LoRA without the adapters' factors."""
        if self.lora is None:
            return hf_state_entries(self.model)
        from hf_mcore_bridge.grpo.backends.dtensor.lora import hf_entries

        return hf_entries(self.model)

    def _adapters(self) -> dict[str, Any]:
        if self.lora is None:
            return {}
        from hf_mcore_bridge.grpo.backends.dtensor.lora import adapter_of

        return adapter_of(self.model)

    def _expert_pieces(self) -> dict[str, Any]:
        from hf_mcore_bridge.grpo.backends.dtensor.experts import expert_pieces

        return expert_pieces(self.model.config)

    def adapted_names(self) -> list[str]:
        """The HF weights of the adapted projections (LoRA; each adapted expert's under its per-expert names), in
        the stream's order; empty without LoRA."""
        adapted = set(self._adapters())
        return [spec[0] for source, spec in self._specs() if source in adapted]

    def hf_specs(self) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
        """(name, global shape, dtype) of what `hf_weights` yields, in its order, without communication."""
        return [(name, shape, dtype) for _, (name, shape, dtype) in self._specs()]

    def _specs(self) -> list[tuple[str, tuple[str, tuple[int, ...], torch.dtype]]]:
        """`hf_specs`, each with the in-memory name it comes from."""
        from hf_mcore_bridge.grpo.backends.dtensor.experts import piece_shape

        pieces = self._expert_pieces()
        specs = []
        for name, value in self._entries():
            dtype = self.dtype if value.is_floating_point() else value.dtype
            shape = tuple(value.shape)
            for piece in pieces.get(name, ()):
                specs.append((name, (piece.name, piece_shape(shape, piece), dtype)))
            if name not in pieces:
                specs.append((name, (name, shape, dtype)))
        return specs


def _weighted_means(results: list[dict[str, float]]) -> dict[str, float]:
    """Token-weighted means of per-micro-batch metrics; loss terms are sums (each already globally normalised)."""
    summed = {"loss", "pg_loss", "kl_loss", "num_valid_tokens"}
    total = sum(r["num_valid_tokens"] for r in results) or 1.0
    return {
        key: sum(r[key] for r in results)
        if key in summed
        else sum(r[key] * r["num_valid_tokens"] for r in results) / total
        for key in results[0]
    }


class _SwappedIn:
    """Context manager: the given shard values in place of the current ones (None: no swap)."""

    def __init__(self, model: torch.nn.Module, values: list[torch.Tensor] | None) -> None:
        self.params = list(model.parameters())
        self.values = values
        self.saved: list[torch.Tensor] = []

    def __enter__(self) -> None:
        if self.values is not None:
            self.saved = [p.detach().clone() for p in self.params]
            with torch.no_grad():
                for param, value in zip(self.params, self.values, strict=True):
                    param.copy_(value)

    def __exit__(self, *exc: object) -> None:
        with torch.no_grad():
            for param, value in zip(self.params, self.saved, strict=False):
                param.copy_(value)


def build_dtensor_policy(
    hf_dir: Path | None,
    settings: DTensorConfig,
    dtype: torch.dtype,
    total_optimizer_steps: int,
    keep_reference: bool,
    model: torch.nn.Module | None = None,
    lora: LoraConfig | None = None,
) -> DTensorPolicy:
    """This rank's sharded policy loaded from `hf_dir`, with optimizer and scheduler (collective). `model`: an HF
    model already built in fp32 (random weights, any attention implementation) to shard instead of reading
    `hf_dir`: how `scripts/bench_training.py` measures the trainer's own DTensor step. `lora` (enabled): PEFT's
    LoRA layers injected before sharding (`backends.dtensor.lora`), the optimizer holding the adapters alone."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    tp = settings.tensor_parallel_size
    mesh = make_mesh(dist.get_world_size() // tp, tp, device_type)  # the world is dp_shard x tp (`ParallelDims`)
    if model is None:
        if hf_dir is None:
            raise ValueError("build_dtensor_policy needs hf_dir or model")
        model = load_hf_model(hf_dir)
    lora = lora if lora is not None and lora.enabled else None
    if lora is not None:
        from hf_mcore_bridge.grpo.backends.dtensor.lora import add_peft_lora

        add_peft_lora(model, lora)
    parallelize_hf_model(
        model,
        mesh,
        param_dtype=dtype,
        reduce_dtype=torch.float32,
        activation_checkpointing=settings.activation_checkpointing,
    )
    model.train()
    beta1, beta2 = settings.betas
    optimizer = torch.optim.AdamW(
        _param_groups(model, settings.weight_decay),
        lr=settings.lr,
        betas=(beta1, beta2),
        eps=settings.eps,
        fused=device_type == "cuda",  # one kernel over parameters, gradients and states (DTensors included)
    )
    scheduler = lr_scheduler(optimizer, settings.scheduler, settings.lr, total_optimizer_steps)
    reference = [p.detach().clone() for p in model.parameters()] if keep_reference else None
    return DTensorPolicy(model, optimizer, scheduler, mesh, settings, dtype, reference, lora=lora)
