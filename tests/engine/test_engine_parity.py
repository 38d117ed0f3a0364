"""The engine against transformers, for each architecture: greedy tokens identical to `generate`, per-token
log-probs equal (within 1e-5) to log_softmax(logits / temperature) of a transformers forward pass."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    ARCH_NAMES,
    VOCAB,
    engine_from_hf,
    hf_greedy,
    hf_token_logprobs,
    random_prompts,
)
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from hf_mcore_bridge.engine import SamplingParams

LENGTHS = [5, 11, 23]  # different lengths; with block_size 4 the last blocks are partially filled


@pytest.mark.parametrize(
    ("arch", "kernel"),
    [(arch, kernel) for kernel in ("gather", "flex") for arch in ARCH_NAMES]
    # the kernel is architecture-blind and the interpreter slow: Llama through the fused RoPE / cache write (opt-in),
    # Qwen3 (per-head q/k norms) through the separate steps
    + [("llama", "triton+fused_rope"), ("qwen3", "triton")],
)
def test_greedy_matches_transformers_generate(arch, kernel, get_hf_model):
    """Every decode attention kernel; FlexAttention runs eagerly here and the Triton kernel in Triton's interpreter
    (the CUDA tests run both compiled)."""
    model = get_hf_model(arch)
    kernel, _, fused = kernel.partition("+")
    engine = engine_from_hf(model, decode_attention=kernel, flex_min_batch=1, fused_rope=fused == "fused_rope")
    prompts = random_prompts(LENGTHS, seed=1)
    outputs = engine.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=12))
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, 12)
        assert output.prompt_token_ids == prompt
        assert [s.index for s in output.samples] == [0, 1, 2]
        for sample in output.samples:
            assert sample.token_ids == reference
            assert sample.finish_reason == "length"
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=1.0)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("arch", ARCH_NAMES)
def test_sampled_logprobs_match_transformers_forward(arch, get_hf_model):
    """Log-probs are under the temperature-scaled distribution, before top-k/top-p truncation."""
    model = get_hf_model(arch)
    engine = engine_from_hf(model)
    prompts = random_prompts([7, 16], seed=2)
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, max_tokens=10, seed=123)
    outputs = engine.generate(prompts, params)
    distinct = set()
    for prompt, output in zip(prompts, outputs, strict=True):
        for sample in output.samples:
            distinct.add(tuple(sample.token_ids))
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=0.7)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)
    assert len(distinct) > 2, "sampling at temperature 0.7 should give different completions"


def test_stop_token_ends_sample_like_transformers_eos(get_hf_model):
    model = get_hf_model("llama")
    engine = engine_from_hf(model)
    prompt = random_prompts([9], seed=3)[0]
    free_run = hf_greedy(model, prompt, 12)
    stop = free_run[4]
    first = free_run.index(stop)
    reference = hf_greedy(model, prompt, 12, eos=stop)
    assert reference == free_run[: first + 1]
    (output,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=(stop,)))
    assert output.samples[0].token_ids == reference
    assert output.samples[0].finish_reason == "stop"


def test_max_model_len_ends_sample_with_length(get_hf_model):
    model = get_hf_model("mistral")
    engine = engine_from_hf(model, max_model_len=20, max_num_batched_tokens=64)
    prompt = random_prompts([15], seed=4)[0]
    (output,) = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=50))
    assert output.samples[0].finish_reason == "length"
    assert output.samples[0].token_ids == hf_greedy(model, prompt, 5)


def _word_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    return tokenizer


def test_text_prompts_go_through_the_tokenizer(get_hf_model):
    model = get_hf_model("qwen2")
    tokenizer = _word_tokenizer()
    engine = engine_from_hf(model)
    engine.tokenizer = tokenizer
    text = "w17 w3 w150 w42 w9 w77"
    (output,) = engine.generate([text], SamplingParams(temperature=0.0, max_tokens=6))
    prompt = tokenizer.encode(text).ids
    reference = hf_greedy(model, prompt, 6)
    assert output.prompt_token_ids == prompt
    assert output.samples[0].token_ids == reference
    assert output.samples[0].text == tokenizer.decode(reference)


def test_logprobs_can_be_switched_off(get_hf_model):
    engine = engine_from_hf(get_hf_model("llama"))
    (output,) = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, logprobs=False, seed=0))
    assert output.samples[0].logprobs is None
    assert len(output.samples[0].token_ids) == 3


def test_rejects_bad_prompts(get_hf_model):
    engine = engine_from_hf(get_hf_model("llama"))
    with pytest.raises(ValueError, match="tokenizer"):
        engine.generate(["no tokenizer here"])
    with pytest.raises(ValueError, match="token ids"):
        engine.generate([[VOCAB]])
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([list(range(64))])
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine.generate([[1]], SamplingParams(n=9))
    assert torch.is_tensor(engine.kv_cache)
