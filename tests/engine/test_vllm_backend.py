"""Contract test of `VllmEngine`; runs only where vLLM (and a GPU) are installed, skips everywhere else."""

from __future__ import annotations

import pytest
import torch

vllm = pytest.importorskip("vllm")

from engine_helpers import build_hf_model, hf_greedy, random_prompts  # noqa: E402

from hf_mcore_bridge.engine import EngineConfig, SamplingParams, VllmEngine  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="vLLM needs a CUDA device"),
]


def test_vllm_backend_generates_refits_and_sleeps(tmp_path):
    first, second = build_hf_model("llama", 0), build_hf_model("llama", 1)
    first.save_pretrained(tmp_path)
    engine = VllmEngine(
        tmp_path,
        EngineConfig(
            dtype=torch.float32, device="cuda", max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=1 << 26
        ),
        skip_tokenizer_init=True,
    )
    prompts = random_prompts([5, 11], seed=13)
    greedy = SamplingParams(n=2, temperature=0.0, max_tokens=8)
    outputs = engine.generate(prompts, greedy)
    for prompt, output in zip(prompts, outputs, strict=True):
        assert [s.token_ids for s in output.samples] == [hf_greedy(first, prompt, 8)] * 2
    engine.load_weights(second.state_dict().items())
    outputs = engine.generate(prompts, greedy)
    assert [o.samples[0].token_ids for o in outputs] == [hf_greedy(second, p, 8) for p in prompts]
    engine.sleep(level=1)
    engine.wake_up()
    assert [o.samples[0].token_ids for o in engine.generate(prompts, greedy)] == [
        hf_greedy(second, p, 8) for p in prompts
    ]
