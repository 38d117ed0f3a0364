"""PEFT's adapter directory for the adapters of `megatron.lora`: `adapter_config.json` and
`adapter_model.safetensors` under PEFT's names, which `peft.PeftModel.from_pretrained` loads onto the base HF model,
and the way back (a PEFT directory's A and B by HF module name, for `megatron.lora.set_adapters`).

PEFT names an adapter `base_model.model.<HF module>.lora_A.weight` (and `lora_B`); our adapters are keyed by the HF
module name, so the names map 1:1. Assumes PEFT's plain LoRA: no DoRA, no rsLoRA, no bias, no `modules_to_save`
(a directory that asks for any of them is refused by name when read).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.megatron.lora_config import LoraConfig

__all__ = ["peft_adapter_config", "read_peft_adapter", "write_peft_adapter"]

PREFIX = "base_model.model."
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PLAIN = {"use_dora": (False, None), "use_rslora": (False, None), "modules_to_save": (None, []), "bias": ("none", None)}
"""PEFT settings this reader takes only at these values (absent is fine)."""


def peft_adapter_config(lora: LoraConfig, base_model: str | None = None) -> dict[str, Any]:
    """PEFT's `adapter_config.json` for `lora` (a LoRA for a causal LM)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": lora.rank,
        "lora_alpha": int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.target_modules),
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
    """Write whole adapters (HF module name -> (A, B), e.g. `megatron.lora.full_adapters`) as a PEFT directory."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, (a, b) in values.items():
        tensors[f"{PREFIX}{name}.lora_A.weight"] = a.detach().cpu().contiguous()
        tensors[f"{PREFIX}{name}.lora_B.weight"] = b.detach().cpu().contiguous()
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
    targets = config["target_modules"]
    lora = LoraConfig(
        enabled=True,
        rank=int(config["r"]),
        alpha=float(config["lora_alpha"]),
        target_modules=tuple(sorted(targets if isinstance(targets, list) else [targets])),
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
    return lora, {name: (pair["lora_A"], pair["lora_B"]) for name, pair in pairs.items()}
