"""PEFT's adapter directory for the adapters of `megatron.lora`: `adapter_config.json` and
`adapter_model.safetensors` under PEFT's names, which `peft.PeftModel.from_pretrained` loads onto the base HF model,
and the way back (a PEFT directory's A and B by HF module name, for `megatron.lora.set_adapters`).

PEFT names an adapter `base_model.model.<HF module>.lora_A.weight` (and `lora_B`); our adapters are keyed by the HF
module name, so the names map 1:1. Routed experts' adapters (`megatron.lora_experts.expert_name`:
`<fused tensor>[<expert>]`, one per expert) are PEFT's `target_parameters` adapters of the fused tensor
(`lora.ParamWrapper`): on the experts module (`model.layers.0.mlp.experts`), nested in transformers' parameter order
(`gate_up_proj` inside `down_proj`, so with both targeted gate_up_proj's is `experts.base_layer.lora_A.weight` and
down_proj's `experts.lora_A.weight`); lora_A [experts * rank, in] holds expert e's A in rows e * rank ...
(e + 1) * rank - 1, lora_B [out, rank * experts] its B in columns e, e + experts, ... (PEFT's `get_delta_weight`:
B reshaped to [out, rank, experts]).

Assumes PEFT's plain LoRA: no DoRA, no rsLoRA, no bias, no `modules_to_save` (a directory that asks for any of them
is refused by name when read).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.megatron.lora_config import EXPERT_PROJECTIONS, LoraConfig, expert_targets, peft_targets
from hf_mcore_bridge.megatron.lora_experts import EXPERT_NAME, expert_name

__all__ = ["peft_adapter_config", "read_peft_adapter", "write_peft_adapter"]

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PLAIN = {"use_dora": (False, None), "use_rslora": (False, None), "modules_to_save": (None, []), "bias": ("none", None)}
"""PEFT settings this reader takes only at these values (absent is fine)."""


def peft_adapter_config(lora: LoraConfig, base_model: str | None = None) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for `lora` (a LoRA for a causal LM; the experts' targets as PEFT's
    `target_parameters`)."""
    experts = expert_targets(lora)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(t for t in lora.target_modules if t not in experts),
        **({"target_parameters": sorted(experts)} if experts else {}),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def write_peft_adapter(
    values: Mapping[str, tuple[torch.Tensor, torch.Tensor]], lora: LoraConfig, out_dir: Path, base_model: str | None
) -> Path:
    """Write whole adapters (HF module name -> (A, B), e.g. `megatron.lora.full_adapters`, every expert's among
    them) as a PEFT directory. ValueError: a fused expert tensor with some of its experts' adapters missing."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    experts: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
    for name, (a, b) in values.items():
        found = EXPERT_NAME.fullmatch(name)
        if found:
            experts.setdefault(found[1], {})[int(found[2])] = (a.detach().cpu(), b.detach().cpu())
            continue
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.detach().cpu().contiguous()
    for fused, pairs in experts.items():
        if sorted(pairs) != list(range(len(pairs))):
            raise ValueError(f"{fused}: adapters of experts {sorted(pairs)}, not of every expert 0..{len(pairs) - 1}")
        key = _expert_key(fused, lora)
        tensors[f"{key}.lora_A.weight"] = torch.cat([pairs[e][0] for e in range(len(pairs))]).contiguous()
        # [out, rank, experts] -> [out, rank * experts]: expert e's B in columns e, e + experts, ...
        stacked = torch.stack([pairs[e][1] for e in range(len(pairs))], dim=-1)
        tensors[f"{key}.lora_B.weight"] = stacked.reshape(stacked.shape[0], -1).contiguous()
    save_file(tensors, str(out_dir / WEIGHTS_FILE), metadata={"format": "pt"})
    (out_dir / CONFIG_FILE).write_text(json.dumps(peft_adapter_config(lora, base_model), indent=2) + "\n")
    return out_dir


def read_peft_adapter(directory: Path) -> tuple[LoraConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """A PEFT LoRA directory's config (as ours) and its A and B by HF module name. ValueError naming the setting or
    tensor: not a LoRA, DoRA / rsLoRA / bias / modules_to_save, a name outside PEFT's scheme, an A without its B."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config = json.loads((directory / CONFIG_FILE).read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{directory / CONFIG_FILE}: peft_type {config.get('peft_type')!r}, not LORA")
    for key, plain in _PLAIN.items():
        if config.get(key) not in plain:
            raise ValueError(f"{directory / CONFIG_FILE}: {key}={config[key]!r} is not implemented")
    lora = LoraConfig(
        enabled=True,
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted(peft_targets(config))),
    )
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(directory / WEIGHTS_FILE)).items():
        if not key.startswith(PREFIX) or not key.endswith((".lora_A.weight", ".lora_B.weight")):
            raise ValueError(f"{directory / WEIGHTS_FILE}: {key} is not a PEFT LoRA tensor name")
        name, factor = key.removeprefix(PREFIX).rsplit(".", 2)[:2]
        pairs.setdefault(name, {})[factor] = tensor
    for name, pair in pairs.items():
        if set(pair) != {"lora_A", "lora_B"}:
            raise ValueError(f"{directory / WEIGHTS_FILE}: {name} has {sorted(pair)}, not lora_A and lora_B")
    values = {}
    for name, pair in pairs.items():
        fused = _expert_of_key(name, lora)
        if fused is None:
            values[name] = (pair["lora_A"], pair["lora_B"])
        else:
            values |= _split_experts(fused, pair["lora_A"], pair["lora_B"], lora.rank, directory / WEIGHTS_FILE)
    return lora, values


_BASE = ".base_layer"


def _expert_key(fused: str, lora: LoraConfig) -> str:
    """PEFT's key (without `.lora_A.weight`) of the `target_parameters` adapter of a fused expert tensor: on its
    module, inside one `base_layer` per targeted parameter that transformers defines after it."""
    module, parameter = fused.rsplit(".", 1)
    targeted = [t.rsplit(".", 1)[1] for t in expert_targets(lora)]
    depth = len(targeted) - 1 - targeted.index(parameter)
    return f"{PREFIX}{module}{_BASE * depth}"


def _expert_of_key(name: str, lora: LoraConfig) -> str | None:
    """The fused expert tensor a PEFT adapter name (module path, `base_layer`s included) is on; None: a module's."""
    targeted = [t.rsplit(".", 1)[1] for t in expert_targets(lora)]
    module, depth = name, 0
    while module.endswith(_BASE):
        module, depth = module.removesuffix(_BASE), depth + 1
    if not targeted or not module.endswith(f".{EXPERT_PROJECTIONS[0].split('.')[0]}") or depth >= len(targeted):
        return None
    return f"{module}.{targeted[len(targeted) - 1 - depth]}"


def _split_experts(
    fused: str, a: torch.Tensor, b: torch.Tensor, rank: int, where: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """A `target_parameters` adapter's per-expert (A, B), keyed as `megatron.lora_experts.expert_name`."""
    experts = a.shape[0] // rank
    if a.shape[0] != experts * rank or b.shape[1] != a.shape[0]:
        raise ValueError(f"{where}: {fused}'s lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} are not rank {rank}")
    per_expert = b.reshape(b.shape[0], rank, experts)
    rows = a.reshape(experts, rank, a.shape[1])
    return {expert_name(fused, e): (rows[e].clone(), per_expert[:, :, e].clone()) for e in range(experts)}
