"""The engine with `fp8_weights` (per-block FP8 attention and MLP projections) against transformers running the
same model with those weights fake-quantized by a quantizer written here, before and after a refit; the engine with
an FP8 KV cache against transformers' unquantized log-probs, within a stated tolerance."""

from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import build_hf_model, engine_from_hf, hf_token_logprobs, hub_weights, random_prompts

from hf_mcore_bridge.engine import SamplingParams

E4M3 = torch.float8_e4m3fn
PARAMS = SamplingParams(n=1, temperature=0.0, max_tokens=8)


def _fake_quantized(weight: torch.Tensor) -> torch.Tensor:
    """Each 128 x 128 block scaled by amax / 448, rounded to e4m3 and scaled back (block by block)."""
    out = torch.empty_like(weight)
    for i in range(0, weight.shape[0], 128):
        for j in range(0, weight.shape[1], 128):
            block = weight[i : i + 128, j : j + 128]
            amax = block.abs().max()
            scale = amax / 448 if amax > 0 else torch.tensor(1.0)
            out[i : i + 128, j : j + 128] = (block / scale).to(E4M3).float() * scale
    return out


def _fake_quantized_model(model: torch.nn.Module) -> torch.nn.Module:
    """A copy whose projections hold what the engine multiplies by: its fused q|k|v and gate|up rows quantized
    as one matrix each (their blocks span the parts), o and down alone."""
    fake = copy.deepcopy(model)
    with torch.no_grad():
        for layer in fake.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for parts in ((attn.q_proj, attn.k_proj, attn.v_proj), (mlp.gate_proj, mlp.up_proj)):
                fused = _fake_quantized(torch.cat([p.weight for p in parts]))
                for part, value in zip(parts, fused.split([p.weight.shape[0] for p in parts]), strict=True):
                    part.weight.copy_(value)
            for single in (attn.o_proj, mlp.down_proj):
                single.weight.copy_(_fake_quantized(single.weight))
    return fake


def _max_gap(engine: object, reference: torch.nn.Module, prompts: list[list[int]]) -> float:
    gaps = []
    for prompt, output in zip(prompts, engine.generate(prompts, PARAMS), strict=True):
        sample = output.samples[0]
        want = hf_token_logprobs(reference, prompt, sample.token_ids, 0.0)
        gaps += [abs(a - b) for a, b in zip(sample.logprobs, want, strict=True)]
    return max(gaps)


def test_fp8_engine_equals_fake_quantized_transformers_and_requantizes_at_a_refit() -> None:
    prompts = random_prompts([5, 9, 3], seed=4)
    model = build_hf_model("llama", seed=0)
    engine = engine_from_hf(model, fp8_weights=True)
    assert _max_gap(engine, _fake_quantized_model(model), prompts) < 1e-5
    # the quantization shows: against the unquantized model the same tokens' log-probs move (bounded)
    gap = _max_gap(engine, model, prompts)
    assert 1e-3 < gap < 0.5, gap
    scales = engine.model.model.layers[0].self_attn.qkv_proj.fp8[1].clone()

    refit = build_hf_model("llama", seed=1)
    engine.load_weights(hub_weights(refit))
    assert _max_gap(engine, _fake_quantized_model(refit), prompts) < 1e-5
    assert not torch.equal(engine.model.model.layers[0].self_attn.qkv_proj.fp8[1], scales)


def test_fp8_kv_cache_log_probs_agree_with_transformers_within_tolerance() -> None:
    """Decode reads keys and values rounded to e4m3 (relative step 2^-3, so up to 2^-4 error each): the sampled
    tokens' log-probs move by more than fp32 rounding (5e-7 with an fp32 cache) but stay within 0.1 of
    transformers' on this tiny model (measured: 0.049 at scales 0.5 and 1). The cache holds a quarter of an fp32
    cache's bytes per block: four times the blocks."""
    prompts = random_prompts([5, 9, 3], seed=4)
    model = build_hf_model("llama", seed=0)
    engine = engine_from_hf(model, kv_cache_dtype="fp8", kv_cache_scale=0.5, decode_attention="gather")
    assert engine.kv_cache is not None and engine.kv_cache.dtype == E4M3
    assert engine.num_blocks == 4 * engine_from_hf(model).num_blocks
    gap = _max_gap(engine, model, prompts)
    assert 1e-4 < gap < 0.1, gap


def test_fp8_kv_cache_settings_are_checked() -> None:
    model = build_hf_model("llama", seed=0)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        engine_from_hf(model, kv_cache_dtype="int8")
    with pytest.raises(ValueError, match="kv_cache_scale must be a positive finite number"):
        engine_from_hf(model, kv_cache_dtype="fp8", kv_cache_scale=0.0)
    with pytest.raises(ValueError, match="needs decode_attention triton or gather"):
        engine_from_hf(model, kv_cache_dtype="fp8", decode_attention="flex")


def test_engine_without_fp8_weights_holds_no_fp8_copy() -> None:
    engine = engine_from_hf(build_hf_model("llama", seed=0))
    engine.generate(random_prompts([4], seed=1), PARAMS)
    assert all(getattr(m, "fp8", None) is None for m in engine.model.modules())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_and_bf16_greedy_tokens_agreement_on_cuda() -> None:
    """FP8 vs bf16 greedy tokens on a fixed prompt set: the agreement rate is printed, not asserted equal."""
    model = build_hf_model("llama", seed=0)
    prompts = random_prompts([5, 9, 3, 12, 7, 20, 4, 16], seed=4)
    settings = dict(device="cuda", dtype=torch.bfloat16, kv_cache_memory_bytes=16 << 20)
    bf16 = [o.samples[0].token_ids for o in engine_from_hf(model, **settings).generate(prompts, PARAMS)]
    fp8 = [
        o.samples[0].token_ids for o in engine_from_hf(model, fp8_weights=True, **settings).generate(prompts, PARAMS)
    ]
    same = sum(a == b for x, y in zip(bf16, fp8, strict=True) for a, b in zip(x, y, strict=False))
    rate = same / sum(len(x) for x in bf16)
    print(f"fp8 vs bf16 greedy token agreement: {rate:.3f}")
    assert 0.0 <= rate <= 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_kv_cache_through_the_triton_kernels_on_cuda() -> None:
    """The CPU test's tolerance, on CUDA through the fused RoPE / cache write and the Triton decode kernel (fp32
    activations, so the FP8 cache's rounding is the only difference from transformers)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    prompts = random_prompts([5, 9, 3], seed=4)
    model = build_hf_model("llama", seed=0)
    engine = engine_from_hf(model, device="cuda", kv_cache_dtype="fp8", kv_cache_scale=0.5, decode_attention="triton")
    gap = _max_gap(engine, model, prompts)
    print(f"fp8 KV cache (triton) max |dlogprob| against transformers: {gap:.4f}")
    assert 1e-4 < gap < 0.1, gap
