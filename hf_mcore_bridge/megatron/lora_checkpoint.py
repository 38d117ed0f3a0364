"""The LoRA adapters in a megatron-core checkpoint of a LoRA run, read back by HF module name without megatron-core,
and merged into an HF directory of the run's base weights (for `bridge export`).

A LoRA run's checkpoint holds the frozen base model under the ordinary megatron-core keys, its adapters beside each
adapted linear (`<linear>.lora.lora_a.<i>`, `lora_b.<i>`, `megatron.lora`: each global tensor is PEFT's A or B of
the linear's i-th HF projection, stacked over layers as the weight is) and its `policy.lora` in the common state
(`LORA_KEY`: rank, alpha, target modules). Which key is which HF projection comes from the mapping table
(`megatron.lora.targeted_entries`), as the adapters were placed. A routed expert's adapters are on megatron-core's
global expert axis beside the experts' weights (`<layer>.mlp.experts.experts.linear_fc1.lora.lora_a.0`
[experts, rank, in], as `SequentialMLP` writes its experts' tensors), read back per expert under
`megatron.lora_experts.expert_name`; merged into the HF directory's per-expert weights (`expert_weights`). Assumes
the checkpoint's layer stack is either homogeneous (stacked keys, the layer its global index) or per-layer
(`decoder.layers.{i}.`), as megatron-core writes them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.checkpoint.dcp_reader import DCPCheckpoint
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.megatron.lora import LAYER_PREFIX, targeted_entries
from hf_mcore_bridge.megatron.lora_config import LoraConfig
from hf_mcore_bridge.megatron.lora_experts import expert_name, fused_expert_template, is_expert
from hf_mcore_bridge.models.mapping_types import Entry, LayerKind
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = [
    "ADAPTER_MARK",
    "LORA_KEY",
    "checkpoint_adapters",
    "lora_of_common",
    "lora_state",
    "merge_adapters",
]

LORA_KEY = "lora"
"""The common-state key of a LoRA run's `policy.lora` (plain values)."""
ADAPTER_MARK = ".lora.lora_"
"""What every adapter tensor's checkpoint key holds."""


def lora_state(lora: LoraConfig) -> dict[str, Any]:
    """`lora` as the plain values a checkpoint's common state keeps (`torch.load(weights_only=True)` reads them)."""
    state = dataclasses.asdict(lora)
    state["target_modules"] = list(lora.target_modules)
    return state


def lora_of_common(common: Mapping[str, Any]) -> LoraConfig | None:
    """The `policy.lora` a checkpoint's common state carries; None for a checkpoint of full training."""
    saved = common.get(LORA_KEY)
    if saved is None:
        return None
    return LoraConfig(**{**saved, "target_modules": tuple(saved["target_modules"])})


def _read_layer(dcp: DCPCheckpoint, linear: str, factor: str, layer: int) -> torch.Tensor:
    """One factor of one layer: from the stacked key (layer axis first; only that layer's region is read) or the
    per-layer key."""
    stacked = f"{LAYER_PREFIX.format(layer='').rstrip('.')}.{linear}.lora.{factor}"
    if stacked in dcp.tensor_keys():
        shape = dcp.tensor_meta(stacked).shape
        return dcp.read(stacked, (layer,) + (0,) * (len(shape) - 1), (1, *shape[1:]))[0]
    per_layer = f"{LAYER_PREFIX.format(layer=layer)}{linear}.lora.{factor}"
    if per_layer not in dcp.tensor_keys():
        raise CheckpointError(f"{dcp.directory} holds neither {stacked} nor {per_layer} (a LoRA adapter)")
    return dcp.read(per_layer)


def _checkpoint_linear(entry: Entry) -> str:
    """The checkpoint's path of an entry's linear below the layer: an expert's with `experts.` for its local index
    (`mlp.experts.experts.linear_fc1`: megatron-core's `SequentialMLP` stores its experts on a global expert
    axis, the tensor's first after the layer's)."""
    linear = entry.mcore.removeprefix(LAYER_PREFIX).removesuffix(".weight")
    return linear.replace("local_experts.{expert}.", "experts.") if is_expert(entry) else linear


def checkpoint_adapters(
    checkpoint_dir: Path, model_cfg: ModelSpec, lora: LoraConfig
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """HF module name (an expert's: `megatron.lora_experts.expert_name`) -> (A, B), whole, of every adapter of a
    LoRA run's checkpoint (an iteration directory). CheckpointError: an adapter the config's targets imply is
    missing, or one the checkpoint holds is not implied."""
    dcp = DCPCheckpoint(checkpoint_dir)
    result = {}
    read = set()
    for entry in targeted_entries(model_cfg, lora):
        linear = _checkpoint_linear(entry)
        for layer in range(model_cfg.num_layers):
            if entry.layers not in (LayerKind.ALL, model_cfg.layer_kind(layer)):
                continue
            if is_expert(entry):  # [experts, ...]: expert e's A and B (B of gate_up: [gate; up] rows)
                a = _read_layer(dcp, linear, "lora_a.0", layer)
                b = _read_layer(dcp, linear, "lora_b.0", layer)
                fused = fused_expert_template(entry, model_cfg).format(layer=layer)
                result |= {expert_name(fused, e): (a[e], b[e]) for e in range(a.shape[0])}
                read.add(linear)
                continue
            for i, source in enumerate(entry.hf_sources):
                a = _read_layer(dcp, linear, f"lora_a.{i}", layer)
                b = _read_layer(dcp, linear, f"lora_b.{i}", layer)
                result[source.removesuffix(".weight").format(layer=layer)] = (a, b)
            read.add(linear)
    held = {k for k in dcp.tensor_keys() if ADAPTER_MARK in k and "optimizer." not in k}  # `chained_<i>.optimizer.`
    stray = sorted(k for k in held if not any(f".{linear}.lora." in k for linear in read))
    if stray:
        raise CheckpointError(f"{checkpoint_dir}: adapter {stray[0]} is not one of policy.lora's targets")
    return result


def merge_adapters(
    hf_dir: Path,
    adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]],
    scale: float,
) -> None:
    """Rewrite the safetensors files of the HF directory `hf_dir` (written by this tool) with each adapted weight
    W + (B A) * scale, the product in fp32 and added in W's dtype (PEFT's `merge_and_unload` arithmetic on CPU). A
    routed expert's adapter (`<fused tensor>[<expert>]`) is merged into that expert's per-expert tensors (its
    product's gate rows then up rows for `gate_up_proj`; the checkpoint's names, from `hf_dir`'s config.json).
    CheckpointError: an adapter without its weight there."""
    from safetensors.torch import load_file, save_file

    wanted = _merge_targets(hf_dir, adapters)
    merged = set()
    for file in sorted(hf_dir.glob("*.safetensors")):
        tensors = load_file(str(file))
        hits = wanted.keys() & tensors.keys()
        if not hits:
            continue
        for name in hits:
            (a, b), rows = wanted[name]
            weight = tensors[name]
            delta = ((b.float() @ a.float()) * scale).to(weight.dtype)  # PEFT: fp32 product, cast, then added
            tensors[name] = (weight + (delta if rows is None else delta[rows])).contiguous()
            merged.add(name)
        save_file(tensors, str(file), metadata={"format": "pt"})
    missing = sorted(wanted.keys() - merged)
    if missing:
        raise CheckpointError(f"{hf_dir} holds no {missing[0]} to merge its adapter into")


def _merge_targets(
    hf_dir: Path, adapters: Mapping[str, tuple[torch.Tensor, torch.Tensor]]
) -> dict[str, tuple[tuple[torch.Tensor, torch.Tensor], slice | None]]:
    """HF tensor name -> (its adapter, the rows of the adapter's product it takes; None: all). An expert adapter's
    product is cut into its entry's per-expert tensors in equal row blocks, in the entry's order (gate, then up)."""
    import json

    from hf_mcore_bridge.megatron.lora_experts import EXPERT_NAME

    wanted: dict[str, tuple[tuple[torch.Tensor, torch.Tensor], slice | None]] = {}
    experts: dict[str, tuple[str, ...]] | None = None
    for name, pair in adapters.items():
        found = EXPERT_NAME.fullmatch(name)
        if found is None:
            wanted[f"{name}.weight"] = (pair, None)
            continue
        if experts is None:
            experts = _expert_sources(ModelSpec.from_hf(json.loads((hf_dir / "config.json").read_text())))
        sources = experts.get(found[1])
        if sources is None:
            raise CheckpointError(f"{hf_dir}: no per-expert tensors to merge the adapter {name} into")
        rows = pair[1].shape[0] // len(sources)
        for i, source in enumerate(sources):
            cut = None if len(sources) == 1 else slice(i * rows, (i + 1) * rows)
            wanted[source.format(expert=int(found[2]))] = (pair, cut)
    return wanted


def _expert_sources(model_cfg: ModelSpec) -> dict[str, tuple[str, ...]]:
    """Each fused expert tensor's HF name (`model.layers.0.mlp.experts.gate_up_proj`) -> the per-expert HF names its
    rows are cut into, in order (`{expert}` left to fill: `...experts.{expert}.gate_proj.weight`, `up_proj`)."""
    sources: dict[str, tuple[str, ...]] = {}
    for entry in model_cfg.table():
        if not is_expert(entry):
            continue
        for layer in range(model_cfg.num_layers):
            if entry.layers in (LayerKind.ALL, model_cfg.layer_kind(layer)):
                fused = fused_expert_template(entry, model_cfg).format(layer=layer)
                sources[fused] = tuple(s.format(layer=layer, expert="{expert}") for s in entry.hf_sources)
    return sources
