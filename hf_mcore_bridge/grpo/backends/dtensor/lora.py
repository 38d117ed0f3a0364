"""PEFT's LoRA on the DTensor backend's HF model (`policy.lora`, the same section as the megatron-core backend's).

`add_peft_lora` injects PEFT's LoRA layers into the plain transformers model before it is sharded
(`peft.inject_adapter_in_model`: the model keeps its class and `model.model.layers`; each targeted projection becomes
a PEFT `LoraLayer` holding the frozen `base_layer` and the adapter `default`), freezes every other parameter and
sets the adapters' initial values as the megatron-core backend does (A seeded by `policy.lora.seed` and the module's
HF name, `megatron.lora.initial_a`; B zero), or to a PEFT directory's (`policy.lora.adapter_path`). FSDP2 then
shards base and adapters alike; the optimizer takes the parameters that require gradients, the adapters alone.

Routed experts (`experts.gate_up_proj`, `experts.down_proj`) are PEFT's `target_parameters` adapters of transformers
5's fused expert tensors (`lora.ParamWrapper` on `mlp.experts`, nested in transformers' parameter order: with both
targeted, gate_up_proj's wrapper is `mlp.experts.base_layer` and down_proj's `mlp.experts`): lora_A
[experts * rank, in] holds expert e's A in rows e * rank ..., lora_B [out, rank * experts] its B in columns
e, e + experts, ... (`megatron.lora_peft`). During a forward PEFT parametrizes the fused tensor as W + delta
(`torch.nn.utils.parametrize`), inside the FSDP2 unit's unsharded window, so autograd reaches the factors. Outside,
each expert's adapter is named as on megatron-core (`<fused tensor>[<expert>]`, `megatron.lora_experts.expert_name`),
seeded alike, and written to PEFT directories through `megatron.lora_peft`. Expert adapters take no dropout (PEFT's
`ParamWrapper` has none; refused in the run's config).

The HF view of the model (`hf_entries`, for the refit and its specs): the state dict without the adapter factors,
a base layer's weight under its HF name (`...q_proj.base_layer.weight` -> `...q_proj.weight`,
`...experts.base_layer.base_layer.gate_up_proj` -> `...experts.gate_up_proj`); `adapter_of` finds the adapter of
such a name and `merged_weight` makes the merged W + (B A) * alpha / rank from the gathered factors (PEFT's
`merge_and_unload` arithmetic; per expert for a fused tensor).

Tensor parallelism (`backends.dtensor.parallel`) shards a dense adapter with its base layer. Dropout
(`policy.lora.dropout`) is PEFT's own `lora_dropout`, active in training mode only (the policy's log-prob forwards
run in eval mode), its masks seeded per mini-batch (`megatron.lora_dropout.dropout_rng`). Checkpoints hold the
adapters alone (`backends.dtensor.checkpoint`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.megatron.lora import initial_a
from hf_mcore_bridge.megatron.lora_config import LoraConfig, expert_targets
from hf_mcore_bridge.megatron.lora_experts import expert_name

__all__ = [
    "ADAPTER",
    "adapted_tensor",
    "adapter_of",
    "add_peft_lora",
    "full_adapters",
    "hf_entries",
    "lora_modules",
    "merged_weight",
]

ADAPTER = "default"
"""PEFT's name of the one adapter."""
_FACTORS = (".lora_A.", ".lora_B.")
_BASE = re.compile(r"(\.base_layer)+\.")


def lora_modules(model: torch.nn.Module) -> dict[str, Any]:
    """PEFT module name (`model.layers.0.self_attn.q_proj`, `model.layers.0.mlp.experts.base_layer`) -> PEFT's
    `LoraLayer` there (a `ParamWrapper` for an expert target)."""
    from peft.tuners.lora import LoraLayer

    return {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}


def is_experts(module: Any) -> bool:
    """Whether a `LoraLayer` is PEFT's `target_parameters` adapter of a fused expert tensor."""
    return hasattr(module, "parameter_name")


def adapted_tensor(name: str, module: Any) -> str:
    """The HF (in-memory) name of the tensor a `LoraLayer` named `name` adapts: `...q_proj.weight`, or the fused
    `...mlp.experts.gate_up_proj`."""
    if is_experts(module):
        return f"{_BASE.sub('.', name + '.').rstrip('.')}.{module.parameter_name}"
    return f"{name}.weight"


def adapter_of(model: torch.nn.Module) -> dict[str, Any]:
    """Adapted HF tensor name (as `hf_entries` names it) -> its `LoraLayer`."""
    return {adapted_tensor(name, m): m for name, m in lora_modules(model).items()}


def add_peft_lora(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """Inject PEFT's LoRA layers for `lora` into the unsharded `model`, freeze all but the adapters, set their
    initial values; returns the adapted modules' PEFT names. BridgeError: nothing matched, or an adapter directory
    that does not fit the model (named), expert targets on a model whose experts are not plain fused
    [experts, out, in] tensors."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import inject_adapter_in_model

    experts = expert_targets(lora)
    config = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=[t for t in lora.target_modules if t not in experts],
        target_parameters=list(experts) or None,
    )
    inject_adapter_in_model(config, model, adapter_name=ADAPTER)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(any(f in name for f in _FACTORS))
    modules = lora_modules(model)
    if not modules:
        raise BridgeError(f"LoRA: no module of this model matches target_modules {list(lora.target_modules)}")
    found = {m.parameter_name for m in modules.values() if is_experts(m)}
    missing = [t for t in experts if t.rsplit(".", 1)[1] not in found]
    if missing:
        raise BridgeError(f"LoRA on {missing}: this model has no such fused expert tensor")
    for name, module in modules.items():
        if is_experts(module) and not module._did_swap_in_out_features:  # transformers' [experts, out, in]
            raise BridgeError(f"LoRA on {adapted_tensor(name, module)}: not a plain [experts, out, in] tensor")
    values = _initial_values(modules, lora)
    with torch.no_grad():
        for name, module in modules.items():
            a, b = values[name]
            module.lora_A[ADAPTER].weight.copy_(a)
            module.lora_B[ADAPTER].weight.copy_(b)
    return list(modules)


def _fuse(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert (A_e, B_e), in expert order, as PEFT's fused factors (A rows stacked; B [out, rank, experts])."""
    b = torch.stack([b for _, b in pairs], dim=-1)
    return torch.cat([a for a, _ in pairs]), b.reshape(b.shape[0], -1)


def _unfuse(fused: str, a: torch.Tensor, b: torch.Tensor, experts: int) -> Iterator[tuple[str, tuple]]:
    """PEFT's fused factors of `fused` as per-expert `(expert_name, (A_e, B_e))`."""
    rows = a.reshape(experts, -1, a.shape[-1])
    columns = b.reshape(b.shape[0], -1, experts)
    for e in range(experts):
        yield expert_name(fused, e), (rows[e], columns[:, :, e])


def _initial_values(modules: dict[str, Any], lora: LoraConfig) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT module name -> its (A, B) as PEFT holds them (an expert target's fused)."""
    given: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None
    if lora.adapter_path is not None:
        from hf_mcore_bridge.megatron.lora_peft import read_peft_adapter

        _, given = read_peft_adapter(Path(lora.adapter_path))
    wanted: dict[str, list[str]] = {}
    for name, module in modules.items():
        fused = adapted_tensor(name, module)
        experts = module.num_experts if is_experts(module) else 0
        wanted[name] = [expert_name(fused, e) for e in range(experts)] if experts else [name]
    if given is not None:
        names = {n for each in wanted.values() for n in each}
        if sorted(given) != sorted(names):
            missing = sorted(names ^ set(given))
            raise BridgeError(f"policy.lora.adapter_path={lora.adapter_path}: no adapter for {missing[0]} or no module")
    result = {}
    for name, module in modules.items():
        a, b = module.lora_A[ADAPTER].weight, module.lora_B[ADAPTER].weight
        if given is not None:
            pairs = [given[n] for n in wanted[name]]
        else:
            shape = (lora.rank, a.shape[1])
            pairs = [(initial_a(n, shape, lora), torch.zeros(b.shape[0], lora.rank)) for n in wanted[name]]
        result[name] = _fuse(pairs) if is_experts(module) else pairs[0]
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
        entries.append((_BASE.sub(".", name), value))
    return entries


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def merged_weight(weight: torch.Tensor, module: Any) -> torch.Tensor:
    """W + (B A) * scale of a gathered base weight and `module`'s adapter (its factors gathered: collective); for
    a fused expert tensor [experts, out, in] expert e's W_e + (B_e A_e) * scale."""
    a = _full(module.lora_A[ADAPTER].weight.detach())
    b = _full(module.lora_B[ADAPTER].weight.detach())
    if not is_experts(module):
        return weight + (b @ a) * module.scaling[ADAPTER]
    experts = module.num_experts
    rows = a.reshape(experts, -1, a.shape[-1])  # [experts, rank, in]
    columns = b.reshape(b.shape[0], -1, experts).permute(2, 0, 1)  # [experts, out, rank]
    return weight + torch.bmm(columns, rows) * module.scaling[ADAPTER]


def full_adapters(model: torch.nn.Module) -> Iterator[tuple[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Adapter name -> (A, B), gathered whole (collective: every rank iterates to the end): a dense adapter under
    its HF module name, each routed expert's under `<fused tensor>[<expert>]` (megatron-core's naming)."""
    for name, module in lora_modules(model).items():
        a = _full(module.lora_A[ADAPTER].weight.detach())
        b = _full(module.lora_B[ADAPTER].weight.detach())
        if is_experts(module):
            yield from _unfuse(adapted_tensor(name, module), a, b, module.num_experts)
        else:
            yield name, (a, b)
