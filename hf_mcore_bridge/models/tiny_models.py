"""Tiny HF models built from configs in code (no hub access): for the demo, the tests and the benchmarks.

Shapes are small but exercise what conversions get wrong: grouped-query attention (8 heads, 4 KV groups, so TP
up to 4), an odd vocabulary that needs padding, tied or untied embeddings, Qwen2's q/k/v biases, Qwen3's q/k
norms with a head_dim that is not hidden/heads, Llama-3 RoPE scaling, GLM-4.5's and DeepSeek-V3's sigmoid,
group-limited routers, and DeepSeek-V3's multi-latent attention with YaRN. Every 1-D weight and persistent buffer
(norms, biases, the router's expert score bias) is randomised, so a misplaced one shows; tensors the mapping table
keeps in float32 (`Direct.float32`) stay float32 in a bf16 model, as published checkpoints store them.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import torch

from hf_mcore_bridge.models.mapping_types import keeps_float32
from hf_mcore_bridge.models.registry import get_architecture

TINY_BASE: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 211,
    "max_position_embeddings": 16384,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
"""What every tiny model shares; each architecture's file (`Architecture.tiny`) adds its own fields."""


def tiny_config(architecture: str, **overrides: Any) -> dict[str, Any]:
    """An HF config dict of a tiny model of `architecture` (e.g. `LlamaForCausalLM`)."""
    arch = get_architecture(architecture)
    return {
        **TINY_BASE,
        "model_type": arch.model_type,
        **copy.deepcopy(dict(arch.tiny)),
        "architectures": [architecture],
        **overrides,
    }


def build_tiny_model(
    directory: Path, architecture: str, *, seed: int = 0, dtype: torch.dtype = torch.float32, **overrides: Any
) -> Path:
    """Save a randomly initialised tiny HF model (safetensors) of `architecture` into `directory`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = tiny_config(architecture, **overrides)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    persistent = set(model.state_dict())
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise so mistakes show
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
        for name, buffer in model.named_buffers():
            if name in persistent and buffer.is_floating_point():
                buffer.add_(torch.randn_like(buffer) * 0.1)
    float32 = _float32_names(architecture, persistent)
    kept = {name: tensor.clone() for name, tensor in model.state_dict().items() if name in float32}
    model.to(dtype)
    for name, tensor in kept.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        store = module._parameters if leaf in module._parameters else module._buffers
        store[leaf] = torch.nn.Parameter(tensor, requires_grad=False) if leaf in module._parameters else tensor
    model.save_pretrained(directory)
    return directory


def _float32_names(architecture: str, names: set[str]) -> set[str]:
    """The tensors among `names` that the architecture's table keeps in float32."""
    patterns = [
        re.compile(re.escape(entry.hf).replace(re.escape("{layer}"), r"\d+").replace(re.escape("{expert}"), r"\d+"))
        for entry in get_architecture(architecture).table
        if keeps_float32(entry)
    ]
    return {name for name in names if any(p.fullmatch(name) for p in patterns)}
