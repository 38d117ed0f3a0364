"""CUDA-only checks: the engine on the GPU against transformers, CUDA-graph decode against eager decode, and the
mixture-of-experts models, which decode eagerly even when graphs are asked for."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ARCH_NAMES,
    MOE_ARCH_NAMES,
    build_hf_model,
    hf_token_logprobs,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)

from hf_mcore_bridge.engine import Engine, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _cuda_engine(model, graphs: bool, kernel: str = "auto") -> Engine:
    config = tiny_engine_config(
        device="cuda", use_cuda_graphs=graphs, block_size=16, decode_attention=kernel, flex_min_batch=1
    )
    engine = Engine(model.config, config)
    engine.load_weights(model.state_dict().items())
    return engine


@pytest.mark.parametrize("kernel", ["triton", "flex", "gather"])
@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_cuda_graph_decode_matches_eager_and_transformers(arch, kernel):
    """The Triton kernel and compiled FlexAttention (both reading the blocks in place) and SDPA over gathered
    blocks, eager and in graphs."""
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hf_model(arch, 0)
    model = build_hf_model(arch, 0).to("cuda")
    prompts = random_prompts([5, 20, 33], seed=11)
    params = SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=3)
    eager = _cuda_engine(model, graphs=False, kernel=kernel).generate(prompts, params)
    graphed_engine = _cuda_engine(model, graphs=True, kernel=kernel)
    graphed = graphed_engine.generate(prompts, params)
    assert graphed_engine.num_cuda_graphs > 0
    for prompt, a, b in zip(prompts, eager, graphed, strict=True):
        for sa, sb in zip(a.samples, b.samples, strict=True):
            assert sa.token_ids == sb.token_ids
            assert sb.logprobs == pytest.approx(sa.logprobs, abs=1e-5)
            expected = hf_token_logprobs(reference_model, prompt, sb.token_ids, 0.8)
            assert sb.logprobs == pytest.approx(expected, abs=1e-4)


def test_refit_keeps_captured_graphs_valid():
    first, second = build_hf_model("llama", 0).to("cuda"), build_hf_model("llama", 1).to("cuda")
    engine = _cuda_engine(first, graphs=True)
    prompts = random_prompts([7, 9], seed=12)
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    engine.generate(prompts, greedy)
    engine.load_weights(second.state_dict().items())
    after = engine.generate(prompts, greedy)
    reference = _cuda_engine(second, graphs=False).generate(prompts, greedy)
    assert [o.samples[0].token_ids for o in after] == [o.samples[0].token_ids for o in reference]


@pytest.mark.parametrize("arch", MOE_ARCH_NAMES)
def test_moe_decodes_eagerly_and_matches_transformers(arch):
    torch.backends.cuda.matmul.allow_tf32 = False
    reference_model = build_hf_model(arch, 0)
    engine = Engine(reference_model.config, tiny_engine_config(device="cuda", use_cuda_graphs=True, block_size=16))
    engine.load_weights(hub_weights(reference_model))
    prompts = random_prompts([5, 20, 33], seed=13)
    outputs = engine.generate(prompts, SamplingParams(n=3, temperature=0.8, max_tokens=20, seed=4))
    assert engine.num_cuda_graphs == 0
    for prompt, output in zip(prompts, outputs, strict=True):
        for sample in output.samples:
            expected = hf_token_logprobs(reference_model, prompt, sample.token_ids, 0.8)
            assert sample.logprobs == pytest.approx(expected, abs=1e-4)
