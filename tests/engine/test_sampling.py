"""The pure sampling functions against independent references (transformers' logits warpers, float64 math,
exact inverse-CDF counts), and seeded reproducibility of the engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from engine_helpers import engine_from_hf, random_prompts
from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

from hf_mcore_bridge.engine import SamplingParams
from hf_mcore_bridge.engine.sampling import (
    Sampler,
    SamplingBatch,
    counter_uniforms,
    inverse_cdf_sample,
    sample,
    stream_key,
    temperature_logprobs,
    truncation_mask,
)


def test_temperature_logprobs_are_float64_log_softmax():
    logits = torch.randn(5, 37, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7, 3.0])
    got = temperature_logprobs(logits, temperature)
    t = torch.tensor([1.0, 0.5, 1.0, 1.7, 3.0], dtype=torch.float64)
    expected = torch.log_softmax(logits.double() / t[:, None], dim=-1)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("top_k", "top_p"), [(5, 1.0), (0, 0.8), (12, 0.6), (1, 0.3), (0, 0.05)])
def test_truncation_matches_transformers_warpers(top_k, top_p):
    generator = torch.Generator().manual_seed(top_k + int(100 * top_p))
    logprobs = torch.log_softmax(torch.randn(6, 50, generator=generator) * 2, dim=-1)
    scores = logprobs.clone()
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores > float("-inf")
    got = truncation_mask(logprobs, torch.full((6,), top_k), torch.full((6,), top_p))
    assert torch.equal(got, expected)


def test_truncation_is_per_row():
    logprobs = torch.log_softmax(torch.randn(3, 20, generator=torch.Generator().manual_seed(1)), dim=-1)
    got = truncation_mask(logprobs, torch.tensor([0, 3, 0]), torch.tensor([1.0, 1.0, 0.5]))
    assert got[0].all()
    assert int(got[1].sum()) == 3
    assert 1 <= int(got[2].sum()) < 20


@pytest.mark.parametrize("chunk", [1024, 4, 3, 1])  # one chunk, several with a partial last one, one per token
def test_inverse_cdf_draws_follow_the_probabilities_exactly(chunk):
    """With N uniforms on a regular grid, each token is drawn round(N * p) times, give or take one."""
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.1, 0.0, 0.0, 0.2, 0.0, 0.0])
    draws = 10_000
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws
    logprobs = probs.log().expand(draws, -1)
    tokens = inverse_cdf_sample(logprobs, None, uniforms, chunk=chunk)
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    assert (counts - probs.double() * draws).abs().max() <= 1


def test_two_level_draws_equal_the_flat_inverse_cdf():
    generator = torch.Generator().manual_seed(4)
    logprobs = torch.log_softmax(torch.randn(3000, 211, generator=generator) * 2, dim=-1)
    uniforms = torch.rand(3000, dtype=torch.float64, generator=generator)
    cdf = logprobs.exp().double().cumsum(dim=-1)
    expected = torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
    for chunk in (16, 100, 1024):
        assert torch.equal(inverse_cdf_sample(logprobs, None, uniforms, chunk=chunk), expected)


def test_inverse_cdf_respects_the_truncation_mask():
    logprobs = torch.log_softmax(torch.randn(1, 10, generator=torch.Generator().manual_seed(2)), dim=-1)
    keep = torch.zeros(1, 10, dtype=torch.bool)
    keep[0, [2, 7]] = True
    uniforms = torch.linspace(1e-9, 1 - 1e-9, 500, dtype=torch.float64)
    for chunk in (1024, 3):
        tokens = inverse_cdf_sample(logprobs.expand(500, -1), keep.expand(500, -1), uniforms, chunk=chunk)
        assert set(tokens.tolist()) == {2, 7}


def _uniforms(seed: int, n: int) -> np.ndarray:
    """n draws: 97 streams of one seed, each over consecutive steps."""
    keys = np.array([stream_key(seed, stream) for stream in range(97)], dtype=np.uint64)
    rows = np.arange(n)
    return counter_uniforms(keys[rows % 97], (rows // 97).astype(np.uint64))


def test_counter_uniforms_are_deterministic_distinct_and_uniform():
    n = 20_000
    u = _uniforms(1234, n)
    assert np.array_equal(u, _uniforms(1234, n))
    assert ((u > 0) & (u < 1)).all()
    assert np.unique(u).size == n
    # Kolmogorov-Smirnov distance to the uniform distribution; 0.015 is far above its ~0.006 typical value.
    ecdf = np.arange(1, n + 1) / n
    assert np.abs(np.sort(u) - ecdf).max() < 0.015
    assert (_uniforms(1235, n) != u).mean() > 0.99


def test_splitmix64_matches_its_reference_outputs():
    """SplitMix64 seeded with 0 (state += gamma, then the output function): the first outputs published with
    the algorithm."""
    assert counter_uniforms(np.zeros(2, dtype=np.uint64), np.array([0, 1], dtype=np.uint64)).tolist() == [
        ((0xE220A8397B1DCDAF >> 11) + 0.5) / 2**53,
        ((0x6E789E6AA1B965F4 >> 11) + 0.5) / 2**53,
    ]
    assert stream_key(5, 1) != stream_key(5, 2) != stream_key(6, 1)


def test_greedy_rows_take_the_argmax_and_report_temperature_one_logprobs():
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(3))
    batch = SamplingBatch(
        temperature=torch.tensor([0.0, 0.0, 0.0]),
        top_k=torch.zeros(3, dtype=torch.int64),
        top_p=torch.ones(3),
        uniforms=torch.full((3,), 0.5, dtype=torch.float64),
        any_random=False,
        any_greedy=True,
        any_truncation=False,
    )
    tokens, logprobs = sample(logits, batch)
    assert torch.equal(tokens, logits.argmax(-1))
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None]).squeeze(1))


def _mixed_batch(rows: int, temperature: float, seed: int) -> SamplingBatch:
    """Every third row greedy, the others sampled at `temperature`, no truncation."""
    generator = torch.Generator().manual_seed(seed)
    t = torch.full((rows,), temperature)
    t[::3] = 0.0
    return SamplingBatch(
        temperature=t,
        top_k=torch.zeros(rows, dtype=torch.int64),
        top_p=torch.ones(rows),
        uniforms=torch.rand(rows, dtype=torch.float64, generator=generator),
        any_random=True,
        any_greedy=True,
        any_truncation=False,
        any_scaled=temperature != 1.0,
    )


def _float64_reference(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """The flat inverse CDF over float64 softmax(logits / t) (argmax for greedy rows), and float64 log-probs."""
    t = torch.where(batch.temperature > 0, batch.temperature, 1.0).double()
    logprobs = torch.log_softmax(logits.double() / t[:, None], dim=-1)
    cdf = logprobs.exp().cumsum(dim=-1)
    drawn = torch.searchsorted(cdf, (batch.uniforms * cdf[:, -1])[:, None], right=True).squeeze(1)
    tokens = torch.where(batch.temperature > 0, drawn, logits.argmax(-1))
    return tokens, logprobs.gather(1, tokens[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_untruncated_sampling_equals_the_float64_inverse_cdf(temperature):
    """Without top-k / top-p the draw reads the scores in place (no log-softmax written): same tokens as the flat
    float64 inverse CDF, log-probabilities within float32 rounding."""
    logits = torch.randn(300, 5003, generator=torch.Generator().manual_seed(5)) * 3
    batch = _mixed_batch(300, temperature, seed=6)
    tokens, logprobs = sample(logits, batch)
    expected_tokens, expected_logprobs = _float64_reference(logits, batch)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs.double(), expected_logprobs, atol=1e-5, rtol=0)


def test_compiled_sampler_equals_eager_sampling():
    """`Sampler(compile=True)` (torch.compile's Inductor on this CPU; on CUDA in the engine) draws the eager
    tokens, across batch sizes (a recompilation with a dynamic batch) and with a temperature."""
    sampler = Sampler(compile=True)
    for rows, temperature in ((64, 1.0), (37, 0.7)):
        logits = torch.randn(rows, 5003, generator=torch.Generator().manual_seed(rows)) * 3
        batch = _mixed_batch(rows, temperature, seed=rows + 1)
        tokens, logprobs = sampler(logits, batch)
        assert sampler.compiled
        eager_tokens, eager_logprobs = sample(logits, batch)
        assert torch.equal(tokens, eager_tokens)
        torch.testing.assert_close(logprobs, eager_logprobs, atol=1e-5, rtol=0)


def test_sampler_falls_back_to_eager_when_compilation_fails():
    sampler = Sampler(compile=True)

    def broken(*args):
        raise RuntimeError("no compiler")

    sampler._untruncated._compiled = broken
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(9))
    batch = _mixed_batch(8, 1.0, seed=10)
    with pytest.warns(UserWarning, match="compiled sampling failed, running eagerly: RuntimeError: no compiler"):
        tokens, _ = sampler(logits, batch)
    assert not sampler.compiled
    assert torch.equal(tokens, sample(logits, batch)[0])


def test_seeded_generation_is_reproducible_and_seed_dependent(get_hf_model):
    engine = engine_from_hf(get_hf_model("qwen3"))
    prompts = random_prompts([5, 8, 12], seed=10)
    params = SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=10, seed=42)

    def tokens(outputs):
        return [[s.token_ids for s in o.samples] for o in outputs]

    first = tokens(engine.generate(prompts, params))
    assert tokens(engine.generate(prompts, params)) == first
    other = tokens(engine.generate(prompts, SamplingParams(n=2, temperature=1.0, top_p=0.95, max_tokens=10, seed=43)))
    assert other != first
    # A prompt's samples do not depend on what else is in the batch.
    alone = tokens(engine.generate(prompts[:1], params))
    assert alone[0] == first[0]
