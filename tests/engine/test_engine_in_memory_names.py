"""`engine.load_weights(hf_model.named_parameters())` (TRL-style weight sync) for every supported architecture.

transformers 5 holds a mixture-of-experts model's experts fused (`mlp.experts.gate_up_proj` [E, 2F, H],
`mlp.experts.down_proj` [E, H, F]) and Mixtral's router as `mlp.gate.weight`; the saved checkpoint has per-expert
names instead. The engine's parameters are zeroed first, then filled from the live model's parameters only; the
reference is transformers itself: greedy `generate` tokens and the log-probs of a forward pass. GLM-4.5's router
score bias is a buffer in transformers, not a parameter: its parameters leave exactly that missing (named by the
engine), and its persistent buffers complete it."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ARCH_NAMES,
    GREEDY,
    MOE_ARCH_NAMES,
    hf_greedy,
    hf_token_logprobs,
    persistent_buffers,
    random_prompts,
    tiny_engine_config,
)

from hf_mcore_bridge.engine import Engine, MissingWeightsError


@pytest.mark.parametrize("arch", ARCH_NAMES + MOE_ARCH_NAMES)
def test_named_parameters_of_a_live_model_load(arch, get_hf_model):
    model = get_hf_model(arch)
    engine = Engine(model.config, tiny_engine_config())
    with torch.no_grad():
        for param in engine.model.parameters():
            param.zero_()
    engine.load_weights(model.named_parameters())
    buffers = persistent_buffers(model)
    if buffers:
        assert engine.model.missing_weights() == sorted(name for name, _ in buffers)
        with pytest.raises(MissingWeightsError, match="e_score_correction_bias"):
            engine.check_loaded()
        engine.load_weights(buffers)
    engine.check_loaded()
    prompts = random_prompts([6, 15], seed=31)
    for prompt, output in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        tokens = output.samples[0].token_ids
        assert tokens == hf_greedy(model, prompt, 10)
        expected = hf_token_logprobs(model, prompt, tokens, temperature=1.0)
        assert output.samples[0].logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_fused_expert_tensors_fill_each_experts_slice(arch, get_hf_model):
    """Each expert's gate, up and down rows land where transformers' own forward reads them."""
    model = get_hf_model(arch)
    engine = Engine(model.config, tiny_engine_config())
    engine.load_weights(model.named_parameters())
    layer = 0
    fused = dict(model.named_parameters())
    gate_up = fused[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
    down = fused[f"model.layers.{layer}.mlp.experts.down_proj"]
    experts = engine.model.model.layers[layer].mlp.experts
    width = gate_up.shape[1] // 2
    for expert in range(gate_up.shape[0]):
        gate, up = gate_up[expert].chunk(2, dim=0)  # transformers: linear(x, gate_up_proj[e]).chunk(2, dim=-1)
        stacked = experts.gate_up_proj[expert]
        assert torch.equal(stacked[:width], gate) and torch.equal(stacked[width:], up)
        assert torch.equal(experts.down_proj[expert], down[expert])


def test_a_fused_tensor_with_the_wrong_expert_count_is_refused(get_hf_model):
    model = get_hf_model("qwen3_moe")
    engine = Engine(model.config, tiny_engine_config())
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.gate_up_proj: expected 8 experts"):
        engine.load_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(7, 64, 64))])
    with pytest.raises(ValueError, match=r"experts\.0\.gate_proj\.weight: expected shape"):
        engine.load_weights([("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 60, 64))])
