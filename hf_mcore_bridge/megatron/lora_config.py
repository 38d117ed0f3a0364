"""LoRA's configuration (`policy.lora`, NeMo-RL's shape): which HF projections get adapters, their rank, scale
and initialisation. Standard library only: a run's config is validated before torch is imported.

What is implemented is named here (`PROJECTIONS`, `EXPERT_PROJECTIONS`, `INITS`); `grpo.run.config` refuses
everything else by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "EXPERT_PROJECTIONS",
    "FUSED",
    "INITS",
    "PROJECTIONS",
    "REFITS",
    "TARGETS",
    "LoraConfig",
    "expert_targets",
    "peft_targets",
]

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The HF projection names adapters can target: dense attention and dense MLP linears (the last part of the HF
module's name, as PEFT's `target_modules` matches them)."""

EXPERT_PROJECTIONS = ("experts.gate_up_proj", "experts.down_proj")
"""The routed experts' fused parameters of a mixture-of-experts layer, as PEFT's `target_parameters` names them
(transformers 5's `mlp.experts.gate_up_proj` [experts, 2 * ffn, hidden] and `mlp.experts.down_proj`
[experts, hidden, ffn]): each gets one rank-r adapter per expert (PEFT's `ParamWrapper`), `gate_up_proj`'s over the
fused gate and up rows together. In the order transformers defines them (PEFT nests its wrappers so)."""

TARGETS = PROJECTIONS + EXPERT_PROJECTIONS
"""Every name `target_modules` may hold."""

FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
"""Projections megatron-core computes in one linear (`linear_qkv`, `linear_fc1`): targeted all together or not at
all."""

INITS = ("kaiming", "gaussian")
"""How A is initialised (B starts at zero, so a new adapter leaves the model unchanged): `kaiming`, PEFT's
default (`kaiming_uniform_` with a = sqrt(5)); `gaussian`, normal with std 1 / rank (PEFT's `gaussian`)."""

REFITS = ("merged", "adapters")
"""What a refit after the first streams into the rollout engine: `merged`, each adapted weight as
W + (alpha / rank) B A; `adapters`, the adapters' A and B alone (under 1 % of the bytes on Llama-3.2-1B at rank 16),
which the embedded engine then applies in its linears (`engine.lora`: dense attention and MLP projections,
megatron-core backend). The embedded engine shares the trainer's GPUs, so a merged refit is a device-local copy,
and its decode runs no adapter kernels: on one H200 (1B shape, rank 16) the merged refit took 30 ms against 15 ms,
but generation 0.59 s against 0.82 s of a step (`docs/lora.md`), hence the default."""


@dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the policy's linears: each targeted projection W (out x in) becomes
    W + (alpha / rank) * B A, with A (rank x in) and B (out x rank) trained and W frozen."""

    enabled: bool = False
    """Train adapters instead of the full weights (megatron-core or the DTensor backend)."""
    rank: int = 8
    """The adapters' rank r (PEFT's `r`, NeMo-RL's `dim`)."""
    alpha: float = 16.0
    """The scale's numerator: the adapter's product is multiplied by alpha / rank (PEFT's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout probability on each adapter's input in training forwards (PEFT's `lora_dropout`: B A dropout(x));
    log-prob forwards never drop (`megatron.lora_dropout`)."""
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    """HF projection names that get an adapter, any of `TARGETS`: `PROJECTIONS` (one adapter per projection, also
    where megatron-core fuses several into one linear: q/k/v in `linear_qkv`, gate/up in `linear_fc1`; they match
    dense layers only, as PEFT's `target_modules` do) and `EXPERT_PROJECTIONS` (one adapter per routed expert on its
    `linear_fc1` / `linear_fc2`, PEFT's `target_parameters`)."""
    init: str = "kaiming"
    """How A is initialised, one of `INITS`; B starts at zero."""
    seed: int = 0
    """Seeds A's initialisation (the same on every rank, whatever the layout)."""
    adapter_path: str | None = None
    """Start from an existing PEFT LoRA directory (`adapter_config.json`, `adapter_model.safetensors`, as a run
    writes in `<logger.log_dir>/lora_adapter/` or PEFT's `save_pretrained`): its A and B replace the initialisation.
    Its rank, alpha and target modules must be these (checked before the run starts)."""
    refit: str = "merged"
    """What each refit after the first streams, one of `REFITS`: the adapters themselves (the engine applies them),
    or the merged weights of the adapted projections."""

    @property
    def refits_adapters(self) -> bool:
        """Refits after the first stream the adapters, which the engine applies (`refit: adapters`, validated with
        the run's config); else merged weights."""
        return self.enabled and self.refit == "adapters"

    @property
    def scale(self) -> float:
        """alpha / rank, the factor of the adapters' product."""
        return self.alpha / self.rank


def expert_targets(lora: LoraConfig) -> tuple[str, ...]:
    """The `EXPERT_PROJECTIONS` among `lora.target_modules`, in their order."""
    return tuple(name for name in EXPERT_PROJECTIONS if name in lora.target_modules)


def peft_targets(config: Mapping[str, Any]) -> list[str]:
    """An `adapter_config.json`'s targets as `LoraConfig.target_modules` holds them: its `target_modules` and its
    `target_parameters` (PEFT's names of fused expert tensors)."""
    targets = config.get("target_modules") or []
    parameters = config.get("target_parameters") or []
    return [*(targets if isinstance(targets, list) else [targets]), *parameters]
