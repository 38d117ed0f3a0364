"""GPT-OSS in the engine beyond the shared MoE tests (`test_engine_moe.py` runs it with every other MoE model: greedy
tokens, sampled log-probs, the fast expert paths; `test_engine_in_memory_names.py` its fused, transposed and
interleaved in-memory experts; `test_engine_tp.py` under tensor parallelism).

Here: the Triton decode kernel (in Triton's interpreter), with the fused RoPE / cache write, over the tiny model's
window-6 layer and sinks, past the window, against transformers; that the comparison needs both the window and the
sinks (the engine with either dropped gives other log-probs); the refit's per-expert names; FlexAttention decode
refused by name.
"""

from __future__ import annotations

import pytest
from engine_helpers import (
    GREEDY,
    MOE_CONFIGS,
    engine_from_hf,
    hf_greedy,
    hf_token_logprobs,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)

from hf_mcore_bridge.checkpoint import expert_parts
from hf_mcore_bridge.engine import Engine
from hf_mcore_bridge.engine.model import Attention
from hf_mcore_bridge.mappings.gpt_oss import FUSED_EXPERTS

PROMPTS = [5, 11, 23]
"""Prompt lengths below, past and far past the window (6); ten tokens are generated after each."""


def _check_against_transformers(engine: Engine, model) -> float:
    """Asserts greedy tokens equal to transformers' `generate`; returns the largest log-prob difference."""
    prompts = random_prompts(PROMPTS, seed=21)
    worst = 0.0
    for prompt, output in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        sample = output.samples[0]
        assert sample.token_ids == hf_greedy(model, prompt, GREEDY.max_tokens)
        expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=1.0)
        worst = max(worst, *(abs(a - b) for a, b in zip(sample.logprobs, expected, strict=True)))
    return worst


@pytest.mark.parametrize("fused_rope", [False, True])
def test_triton_decode_with_window_and_sinks_matches_transformers(fused_rope, get_hf_model):
    model = get_hf_model("gpt_oss")
    engine = engine_from_hf(model, decode_attention="triton", fused_rope=fused_rope)
    windows = [m.window for m in engine.model.modules() if isinstance(m, Attention)]
    assert windows == [6, None]
    assert _check_against_transformers(engine, model) < 1e-5


@pytest.mark.parametrize("dropped", ["window", "sinks"])
def test_the_comparison_needs_the_window_and_the_sinks(dropped, get_hf_model):
    """The same engine with its layers' window or sinks dropped: its log-probs move away from transformers'."""
    model = get_hf_model("gpt_oss")
    engine = engine_from_hf(model)
    for module in engine.model.modules():
        if isinstance(module, Attention):
            setattr(module, dropped, None)
    prompts = random_prompts(PROMPTS, seed=21)
    outputs = engine.generate(prompts, GREEDY)
    worst = max(
        abs(a - b)
        for prompt, output in zip(prompts, outputs, strict=True)
        for a, b in zip(
            output.samples[0].logprobs, hf_token_logprobs(model, prompt, output.samples[0].token_ids, 1.0), strict=True
        )
    )
    assert worst > 1e-2


def test_flex_decode_is_refused_for_windows_and_sinks():
    config = MOE_CONFIGS["gpt_oss"]()
    with pytest.raises(ValueError, match="GptOssForCausalLM: decode_attention='flex' implements no sliding window"):
        Engine(config, tiny_engine_config(decode_attention="flex"))


def test_the_refits_per_expert_names_fill_every_parameter(get_hf_model):
    """The trainer's refit streams experts under the table's per-expert linear-layer names (cut from the fused
    tensors as `expert_parts` cuts them): they, with the other tensors, fill every engine parameter and give
    transformers' log-probs."""
    model = get_hf_model("gpt_oss")
    saved = dict(hub_weights(model))
    weights = dict(saved)
    for template, (fused_template, part) in FUSED_EXPERTS.items():
        for layer in range(model.config.num_hidden_layers):
            fused = saved[fused_template.format(layer=layer)]
            weights.pop(fused_template.format(layer=layer), None)
            for expert in range(fused.shape[0]):
                weights[template.format(layer=layer, expert=expert)] = expert_parts.take(fused[expert], part)
    engine = Engine(model.config, tiny_engine_config())
    assert engine.load_weights(weights.items()) == set(engine.model.targets)
    engine.model.check_loaded()
    assert _check_against_transformers(engine, model) < 1e-5


def test_auto_decode_takes_gather_where_it_would_take_flex(monkeypatch):
    """On CUDA without a Triton kernel for the head dimension, `auto` resolves to FlexAttention for other models;
    for GPT-OSS to `gather` (the resolution is checked without a GPU: the model is built on CPU)."""
    config = tiny_engine_config()
    monkeypatch.setattr(type(config), "decode_kernel", lambda self, head_dim=None, latent=False: "flex")
    assert Engine(MOE_CONFIGS["gpt_oss"](), config).model.decode_kernel == "gather"
    assert Engine(MOE_CONFIGS["mixtral"](), config).model.decode_kernel == "flex"
