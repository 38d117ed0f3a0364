"""Tiny HF models built from configs in code (no hub access): for the demo, the tests and the benchmarks.

Shapes are small but exercise what conversions get wrong: grouped-query attention (8 heads, 4 KV groups, so TP
up to 4), an odd vocabulary that needs padding, tied or untied embeddings, Qwen2's q/k/v biases, Qwen3's q/k
norms with a head_dim that is not hidden/heads, and Llama-3 RoPE scaling.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_config(architecture: str, **overrides: Any) -> dict[str, Any]:
    """An HF config dict of a tiny model of `architecture` (e.g. `LlamaForCausalLM`)."""
    base: dict[str, Any] = {
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
    per_arch: dict[str, dict[str, Any]] = {
        "LlamaForCausalLM": {"model_type": "llama", "rope_theta": 500000.0, "rope_scaling": dict(LLAMA3_ROPE)},
        "MistralForCausalLM": {"model_type": "mistral", "sliding_window": None, "head_dim": 16},
        "Qwen2ForCausalLM": {"model_type": "qwen2", "rope_theta": 1000000.0},
        "Qwen3ForCausalLM": {"model_type": "qwen3", "head_dim": 32, "rope_theta": 1000000.0},
        "MixtralForCausalLM": {
            "model_type": "mixtral",
            "num_hidden_layers": 4,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": None,
            "rope_theta": 1000000.0,
        },
        "Qwen3MoeForCausalLM": {
            "model_type": "qwen3_moe",
            "num_hidden_layers": 4,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "mlp_only_layers": [1],
            "norm_topk_prob": True,
            "head_dim": 16,
            "rope_theta": 1000000.0,
        },
        "Qwen2MoeForCausalLM": {
            "model_type": "qwen2_moe",
            "num_hidden_layers": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 48,
            "norm_topk_prob": False,
            "rope_theta": 1000000.0,
        },
    }
    config = {**base, **per_arch[architecture], "architectures": [architecture], **overrides}
    return config


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
    with torch.no_grad():
        for param in model.parameters():  # norms start at 1 and biases at 0: randomise so mistakes show
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.1)
    model.to(dtype).save_pretrained(directory)
    return directory
