"""PEFT's LoRA on the DTensor backend's HF model (`policy.lora`, the same section as the megatron-core backend's).

`add_peft_lora` injects PEFT's LoRA layers into the plain transformers model before it is sharded
(`peft.inject_adapter_in_model`: the model keeps its class and `model.model.layers`; each targeted projection becomes
a PEFT `LoraLayer` holding the frozen `base_layer` and the adapter `default`), freezes every other parameter and
sets the adapters' initial values as the megatron-core backend does (A seeded by `policy.lora.seed` and the module's
HF name, `megatron.lora.initial_a`; B zero), or to a PEFT directory's (`policy.lora.adapter_path`). FSDP2 then
shards base and adapters alike; the optimizer takes the parameters that require gradients, the adapters alone.

The HF view of the model (`hf_entries`, for the refit and its specs): the state dict without the adapter factors,
a base layer's weight under its HF name (`...q_proj.base_layer.weight` -> `...q_proj.weight`); `merged_weight`
makes a targeted weight W + (B A) * alpha / rank from the gathered factors (PEFT's `merge_and_unload` arithmetic).

Assumes and refuses (in the run's config): no tensor parallelism on this backend with LoRA (the TP plan names
`nn.Linear` projections that PEFT has wrapped). Dropout (`policy.lora.dropout`) is PEFT's own `lora_dropout`, active
in training mode only (the policy's log-prob forwards run in eval mode), its masks seeded per mini-batch
(`megatron.lora_dropout.dropout_rng`). Checkpoints hold the adapters alone (`backends.dtensor.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.megatron.lora import initial_a
from hf_mcore_bridge.megatron.lora_config import LoraConfig, expert_targets

__all__ = ["ADAPTER", "add_peft_lora", "full_adapters", "hf_entries", "lora_modules", "merged_weight"]

ADAPTER = "default"
"""PEFT's name of the one adapter."""
_FACTORS = (".lora_A.", ".lora_B.")


def lora_modules(model: torch.nn.Module) -> dict[str, Any]:
    """HF module name (`model.layers.0.self_attn.q_proj`) -> PEFT's `LoraLayer` there."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def add_peft_lora(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Inject PEFT's LoRA layers for `lora` into the unsharded `model`, freeze all but the adapters, set their
    initial values; returns the adapted modules' HF names. BridgeError: nothing matched, or an adapter directory
    that does not fit the model (named), adapters on experts (implemented on the megatron-core backend only)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    if expert_targets(lora):
        raise BridgeError(f"LoRA on {list(expert_targets(lora))}: adapters on experts need the megatron-core backend")

    config = PeftLoraConfig(
        r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, target_modules=list(lora.target_modules)
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(any(f in name for f in _FACTORS))
    modules = lora_modules(model)
    if not modules:
        raise BridgeError(f"LoRA: no module of this model matches target_modules {list(lora.target_modules)}")
    values = _initial_values(modules, lora)
    with torch.no_grad():
        for name, module in modules.items():
            a, b = values[name]
            module.lora_A[ADAPTER].weight.copy_(a)
            module.lora_B[ADAPTER].weight.copy_(b)
    return list(modules)


def _initial_values(modules: dict[str, Any], lora: LoraConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    if lora.adapter_path is not None:
        from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter

        _, values = read_peft_adapter(Path(lora.adapter_path))
        if sorted(values) != sorted(modules):
            missing = sorted(set(modules) ^ set(values))
            raise BridgeError(f"policy.lora.adapter_path={lora.adapter_path}: no adapter for {missing[0]} or no module")
        return values
    result = {}
    for name, module in modules.items():
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        result[name] = (initial_a(name, tuple(a.shape), lora), torch.zeros_like(b))
    return result


def hf_entries(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The state dict's `(hf_name, value)` pairs without the adapter factors, a base layer's weight under its HF
    name, a tied tensor under its first name only."""
    seen: set[int] = set()
    entries = []
    for name, value in model.state_dict().items():
        if any(f in name for f in _FACTORS) or id(value) in seen:
            continue
        seen.add(id(value))
        entries.append((name.replace(".base_layer.", "."), value))
    return entries


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def merged_weight(weight: torch.Tensor, module: Any) -> torch.Tensor:
    """W + (B A) * scale of a gathered base weight and `module`'s adapter (its factors gathered: collective)."""
    a = _full(module.lora_A[ADAPTER].weight.detach())
    b = _full(module.lora_B[ADAPTER].weight.detach())
    return weight + (b @ a) * module.scaling[ADAPTER]


def full_adapters(model: torch.nn.Module) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """HF module name -> (A, B), gathered whole (collective: every rank iterates to the end)."""
    for name, module in lora_modules(model).items():
        a = _full(module.lora_A[ADAPTER].weight.detach())
        b = _full(module.lora_B[ADAPTER].weight.detach())
        yield name, (a, b)
