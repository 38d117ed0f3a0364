"""The fused untruncated sampler (`triton_sampling`, here in Triton's interpreter on CPU) against the flat float64
inverse CDF written in `test_sampling.py`, with greedy and sampled rows mixed, a temperature, a vocabulary that is
not a multiple of the chunk, bf16 logits and an all-sampled batch."""

from __future__ import annotations

import pytest
import torch
from test_sampling import _float64_reference, _mixed_batch

from hf_mcore_bridge.engine.sampling import SamplingBatch
from hf_mcore_bridge.engine.triton_sampling import fused_sample_untruncated

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the kernel runs: compiled on a GPU, else in Triton's interpreter (see conftest)."""


def _fused(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, logprobs = fused_sample_untruncated(
        logits.to(DEVICE),
        batch.temperature.to(DEVICE),
        batch.uniforms.to(DEVICE),
        batch.any_random,
        batch.any_greedy,
        batch.any_scaled,
    )
    return tokens.cpu(), logprobs.cpu()


@pytest.mark.parametrize(("temperature", "dtype"), [(1.0, torch.float32), (0.7, torch.float32), (1.0, torch.bfloat16)])
def test_fused_sampler_equals_the_float64_inverse_cdf(temperature: float, dtype: torch.dtype) -> None:
    logits = (torch.randn(40, 3001, generator=torch.Generator().manual_seed(5)) * 3).to(dtype)
    batch = _mixed_batch(40, temperature, seed=6)
    tokens, logprobs = _fused(logits, batch)
    expected_tokens, expected_logprobs = _float64_reference(logits.float(), batch)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs.double(), expected_logprobs, atol=1e-5, rtol=0)


def test_fused_sampler_without_greedy_rows_and_the_uniforms_matter() -> None:
    logits = torch.randn(16, 2100, generator=torch.Generator().manual_seed(7)) * 2
    batch = _mixed_batch(16, 1.0, seed=8)
    batch = SamplingBatch(
        torch.ones(16),
        batch.top_k,
        batch.top_p,
        batch.uniforms,
        any_random=True,
        any_greedy=False,
        any_truncation=False,
        any_scaled=False,
    )
    tokens, _ = _fused(logits, batch)
    assert torch.equal(tokens, _float64_reference(logits, batch)[0])
    flipped = SamplingBatch(batch.temperature, batch.top_k, batch.top_p, 1 - batch.uniforms, True, False, False, False)
    assert not torch.equal(_fused(logits, flipped)[0], tokens)


def test_engine_with_the_fused_sampler_draws_the_tokens_of_the_torch_sampler(get_hf_model) -> None:
    """The engine's wiring (`EngineConfig.fused_sampler`): a seeded sampling run draws the same tokens with the same
    log-probs either way (the draw depends only on the logits and the counter-based uniforms)."""
    from engine_helpers import engine_from_hf, random_prompts

    from hf_mcore_bridge.engine import SamplingParams

    model = get_hf_model("llama", 0)
    prompts = random_prompts([5, 9], seed=2)
    params = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3)
    engines = [engine_from_hf(model, fused_sampler=fused, device=DEVICE) for fused in (False, True)]
    runs = [engine.generate(prompts, params) for engine in engines]
    for torch_output, fused_output in zip(*runs, strict=True):
        for a, b in zip(torch_output.samples, fused_output.samples, strict=True):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_sampler_falls_back_to_the_torch_path_when_the_fused_kernel_fails(monkeypatch) -> None:
    from hf_mcore_bridge.engine import triton_sampling
    from hf_mcore_bridge.engine.sampling import Sampler, sample

    def broken(*args: object) -> None:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(triton_sampling, "fused_sample_untruncated", broken)
    sampler = Sampler(compile=False, fused=True)
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(9))
    batch = _mixed_batch(8, 1.0, seed=10)
    with pytest.warns(UserWarning, match="fused sampler failed, using the torch sampler: RuntimeError: no compiler"):
        tokens, _ = sampler(logits, batch)
    assert not sampler.fused
    assert torch.equal(tokens, sample(logits, batch)[0])
