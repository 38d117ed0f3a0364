"""The decode-step bound the engine benchmark prints beside each measured step (`scripts/roofline.py`), checked
against a transformers model's own parameters and a hand count of one step's reads and products."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import roofline

CONFIG = LlamaConfig(
    vocab_size=211,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # heads x head_dim (128) differs from hidden (64): a formula that uses hidden for it is caught
    tie_word_embeddings=False,
)


def test_matmul_weights_are_the_weights_of_the_models_linear_layers() -> None:
    """Every `nn.Linear` weight of the HF model (q, k, v, o, gate, up, down and the output layer), nothing else."""
    model = LlamaForCausalLM(CONFIG)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert roofline.matmul_weights(CONFIG) == linear


def test_step_bound_counts_weights_kv_and_flops_and_takes_the_slower_limit() -> None:
    rows, context = 8, 50
    model = LlamaForCausalLM(CONFIG)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    # the KV cache the model itself returns for one sequence of `context` tokens
    with torch.no_grad():
        cache = model(torch.zeros(1, context, dtype=torch.long), use_cache=True).past_key_values
    kv_elements = sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers)
    bound = roofline.decode_step_bound(CONFIG, rows, context, bytes_per_element=2)
    assert bound.weight_bytes == 2 * linear
    assert bound.kv_bytes == 2 * rows * kv_elements
    attention = 2 * 2 * CONFIG.num_attention_heads * CONFIG.head_dim * context * CONFIG.num_hidden_layers
    assert bound.flops == rows * (2 * linear + attention)
    memory_s = (bound.weight_bytes + bound.kv_bytes) / 4.3e12
    assert bound.limit_s == pytest.approx(max(memory_s, bound.flops / 790e12))
    assert bound.bound == "memory"  # 8 rows: far below the ~180 FLOPs per byte where compute binds
    busy = roofline.decode_step_bound(CONFIG, 100_000, 1, bytes_per_element=2)
    assert busy.bound == "compute" and busy.limit_s == pytest.approx(busy.flops / 790e12)
