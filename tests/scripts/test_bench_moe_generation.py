"""The MoE generation benchmark's bound (`scripts/bench_moe_generation.py`): the bytes it counts from the engine's
parameters at Qwen3-30B-A3B's full shape (on meta tensors) against a hand count from the published config, the
step bound against the same arithmetic done here, and its refusal of a shape that does not fit the device."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import bench_moe_generation as bench

from hf_mcore_bridge.engine import EngineConfig, read_spec
from hf_mcore_bridge.engine.model import CausalLM


def _qwen3_30b_a3b() -> tuple[dict, CausalLM]:
    config = bench.MODELS["qwen3-30b-a3b"][0]
    return config, CausalLM(read_spec(config), torch.bfloat16, "meta", 1)


def test_the_bound_counts_qwen3_30b_a3bs_bytes_as_a_hand_count_does():
    """Hidden 2048, 32 heads and 4 KV heads of 128, q/k norms, 48 layers of 128 experts of width 768, an untied
    vocabulary of 151936: 61 GB in bf16 (as the issue says), of which a step reads all but the embedding table."""
    _, model = _qwen3_30b_a3b()
    hidden, head, heads, kv_heads, layers = 2048, 128, 32, 4, 48
    experts, width, vocab = 128, 768, 151936
    per_expert = 3 * hidden * width * 2
    attention = (hidden * (heads + 2 * kv_heads) * head + heads * head * hidden + 2 * head) * 2
    per_layer = attention + 2 * hidden * 2 + experts * hidden * 2  # + the two norms and the router
    dense = layers * per_layer + hidden * 2 + vocab * hidden * 2  # + the final norm and the output layer
    sizes = bench.model_sizes(model, kv_bytes_per_token=layers * 2 * kv_heads * head * 2)
    assert (sizes.expert_bytes, sizes.experts_per_layer, sizes.moe_layers) == (per_expert, experts, layers)
    assert sizes.dense_bytes == dense
    assert sizes.weight_bytes == dense + layers * experts * per_expert + vocab * hidden * 2
    assert 60e9 < sizes.weight_bytes < 62e9


def test_step_bound_is_the_steps_bytes_at_the_h200s_bandwidth():
    _, model = _qwen3_30b_a3b()
    sizes = bench.model_sizes(model, kv_bytes_per_token=98304)
    rows, context, touched = 64, 2304, 48 * 126.0
    expected = (sizes.dense_bytes + touched * sizes.expert_bytes + rows * context * 98304) / 4.3e12
    assert bench.step_bound_s(sizes, rows, context, touched) == pytest.approx(expected, rel=1e-12)
    assert 0.016 < expected < 0.018  # ~17 ms: the 2x goal is ~34 ms a decode step


def test_a_shape_that_does_not_fit_the_device_is_refused_in_one_line(monkeypatch, capsys):
    config, _ = _qwen3_30b_a3b()
    engine_config = EngineConfig(device="cpu", kv_cache_memory_bytes=30 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (80 << 30, 141 << 30))
    with pytest.raises(SystemExit) as exited:
        bench.fits(config, engine_config, torch.device("cuda"))
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: 48 layers need 61.1 GB of weights")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (140 << 30, 141 << 30))
    bench.fits(config, engine_config, torch.device("cuda"))  # 61 + 32 GB fit in 150 GB
