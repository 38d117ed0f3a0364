"""torch.compile'd engine steps (Inductor, here on the CPU; on CUDA in the GPU tests) against their eager
references and against transformers: the pointwise steps equal eagerly computed ones, and an engine built with
`torch_compile=True` generates transformers' greedy tokens with its log-probs."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import engine_from_hf, hf_greedy, hf_token_logprobs, random_prompts

from hf_mcore_bridge.engine import SamplingParams
from hf_mcore_bridge.engine.pointwise import EAGER_OPS, compiled_ops


def test_compiled_pointwise_steps_equal_eager():
    ops = compiled_ops()
    generator = torch.Generator().manual_seed(0)
    for tokens in (8, 13):  # a second shape recompiles with a dynamic size
        x = torch.randn(tokens, 6, 16, generator=generator)
        angles = torch.randn(tokens, 8, generator=generator)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        torch.testing.assert_close(ops.rope(x, cos, sin), EAGER_OPS.rope(x, cos, sin), atol=1e-6, rtol=1e-6)
        gate_up = torch.randn(tokens, 40, generator=generator)
        torch.testing.assert_close(ops.silu_mul(gate_up), EAGER_OPS.silu_mul(gate_up), atol=1e-6, rtol=1e-6)
        h, residual, weight = (torch.randn(tokens, 32, generator=generator) for _ in range(3))
        got, expected = (
            ops.add_rms_norm(h, residual, weight[0], 1e-6),
            EAGER_OPS.add_rms_norm(h, residual, weight[0], 1e-6),
        )
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    assert all(op.compiled for op in (ops.rope, ops.silu_mul, ops.add_rms_norm))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # q and k rotated together / after their per-head norms
def test_compiled_engine_matches_transformers(arch, get_hf_model):
    model = get_hf_model(arch)
    engine = engine_from_hf(model, torch_compile=True)
    prompts = random_prompts([5, 11, 23], seed=3)
    outputs = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=8))
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, 8)
        for sample in output.samples:
            assert sample.token_ids == reference
            assert sample.logprobs == pytest.approx(hf_token_logprobs(model, prompt, reference, 1.0), abs=1e-5)
    sampled = engine.generate(prompts, SamplingParams(n=2, temperature=0.7, max_tokens=8, seed=5))
    for prompt, output in zip(prompts, sampled, strict=True):
        for sample in output.samples:
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=0.7)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)
    assert engine._sampler.compiled and engine.model.ops.rope.compiled
