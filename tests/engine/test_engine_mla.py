"""Multi-latent attention (DeepSeek-V3, Moonlight and GLM-4.7-Flash) in the engine, against transformers.

The tiny models of `tests/tiny_variants.py`: DeepSeek-V3's (low-rank query, YaRN, interleaved RoPE pairs, 4 groups of 4
experts) and Moonlight's (full-rank query, plain rotate-half RoPE, no groups); GLM-4.7-Flash's (plain RoPE, GLM's
router and shared expert, dense layers between MoE ones), built with its published `rms_norm_eps` 1e-5 beside the
latent norms' fixed 1e-6, which the engine must keep apart. Checked: greedy tokens identical to
`generate` and per-token log-probs within 1e-5 of a transformers forward pass (fp32, CPU; latents gathered or read in
place by the Triton latent kernel, experts through the exact or the fast path), the Triton latent kernel alone against a
dense float64 reference, prompts of different lengths in one batch, past several 4-token KV blocks; the cache holds the
latent (kv_lora_rank + qk_rope_head_dim values a token and layer) and `EngineStats` reports its bytes; a corrupted
absorbed projection fails the comparison from the first decoded token on (the prefilled one still matches); a refit and
a sleep/wake cycle update the absorbed projections; the config reading (softmax scale, YaRN tables) equals transformers'
own; refusals.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_helpers import (
    GREEDY,
    build_hf_from_config,
    engine_from_hf,
    hf_greedy,
    hf_token_logprobs,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)
from transformers import AutoModelForCausalLM, PreTrainedModel

from hf_mcore_bridge.engine import Engine, read_spec, triton_mla
from hf_mcore_bridge.engine.kv_cache import SCRATCH_BLOCK
from hf_mcore_bridge.engine.mla import LatentAttention
from hf_mcore_bridge.engine.model import rope_inv_freq
from hf_mcore_bridge.engine.triton_mla import paged_mla_decode
from hf_mcore_bridge.models.tiny_models import build_tiny_model

MLA_MODELS = ("deepseek_v3", "moonlight", "glm4_moe_lite")
KERNEL_MODELS = ("deepseek_v3", "moonlight")
"""Through the Triton kernels (architecture-blind: GLM-4.7-Flash's latent cache and router are DeepSeek-V3's)."""
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton latent kernel runs alone: compiled on a GPU, else in Triton's interpreter (see conftest)."""
NEW_TOKENS = GREEDY.max_tokens


@pytest.fixture(scope="module")
def mla_models(
    tiny_moe_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[Path, PreTrainedModel]]:
    directories = {name: tiny_moe_models[name] for name in KERNEL_MODELS}
    lite = tmp_path_factory.mktemp("glm4-moe-lite") / "hf"
    directories["glm4_moe_lite"] = build_tiny_model(lite, "Glm4MoeLiteForCausalLM", seed=35, rms_norm_eps=1e-5)
    return {
        name: (directory, AutoModelForCausalLM.from_pretrained(directory).eval())
        for name, directory in directories.items()
    }


def _max_logprob_error(
    model: PreTrainedModel, prompt: list[int], tokens: list[int], logprobs: list[float]
) -> list[float]:
    expected = hf_token_logprobs(model, prompt, tokens, temperature=1.0)
    return [abs(a - b) for a, b in zip(logprobs, expected, strict=True)]


@pytest.mark.parametrize("name", MLA_MODELS)
def test_greedy_tokens_and_logprobs_match_transformers_from_a_latent_cache(name, mla_models):
    directory, model = mla_models[name]
    engine = Engine.from_pretrained(directory, tiny_engine_config())
    mla = engine.model_config.mla
    assert mla is not None
    prompts = random_prompts([3, 9, 14], seed=31)  # with 10 new tokens each crosses 3 blocks of 4
    outputs = engine.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        for sample in output.samples:
            assert sample.token_ids == reference
            assert max(_max_logprob_error(model, prompt, sample.token_ids, sample.logprobs)) < 1e-5
    # the cache holds one entry of kv_lora_rank + qk_rope_head_dim values a token and layer, nothing decompressed
    cache = engine.kv_cache
    layers, planes, _, _, heads, width = cache.shape
    assert (layers, planes, heads) == (model.config.num_hidden_layers, 1, 1)
    assert width == model.config.kv_lora_rank + model.config.qk_rope_head_dim == 24 + 8
    per_token = layers * (mla.kv_lora_rank + mla.qk_rope_head_dim) * torch.float32.itemsize
    assert engine.last_stats.kv_bytes_per_token == per_token
    assert cache[:, :, 0, 0].numel() * cache.element_size() == per_token


@pytest.mark.parametrize(("decode", "experts"), [("triton", "exact"), ("gather", "triton")])
@pytest.mark.parametrize("name", KERNEL_MODELS)
def test_triton_latent_decode_and_fast_experts_match_transformers(name, decode, experts, mla_models):
    """The Triton latent decode kernel (`triton_mla`), and DeepSeek-V3's sigmoid router with score bias and groups
    and its shared expert over the fast expert path (the Triton grouped GEMM): compiled on a GPU (fp32, no TF32),
    else in Triton's interpreter."""
    directory, model = mla_models[name]
    torch.backends.cuda.matmul.allow_tf32 = False
    config = tiny_engine_config(decode_attention=decode, moe_kernel=experts, device=TRITON_DEVICE)
    engine = Engine.from_pretrained(directory, config)
    assert (engine.model.decode_kernel, engine.model.moe_kernel) == (decode, experts)
    prompts = random_prompts([3, 9, 14], seed=31)
    for prompt, output in zip(prompts, engine.generate(prompts, GREEDY), strict=True):
        reference = hf_greedy(model, prompt, NEW_TOKENS)
        for sample in output.samples:
            assert sample.token_ids == reference
            assert max(_max_logprob_error(model, prompt, sample.token_ids, sample.logprobs)) < 1e-5


def test_a_corrupted_absorbed_projection_fails_from_the_first_decoded_token(mla_models, monkeypatch):
    """Each head reading its neighbour's W_UK (a layout slip): the prefilled token, which decompresses, still
    matches; every decoded one is off."""
    directory, model = mla_models["deepseek_v3"]
    engine = Engine.from_pretrained(directory, tiny_engine_config())
    absorbed = LatentAttention.absorbed

    def rolled(self: LatentAttention) -> tuple[torch.Tensor, torch.Tensor]:
        w_uk, w_uv = absorbed(self)
        return w_uk.roll(1, dims=0), w_uv

    monkeypatch.setattr(LatentAttention, "absorbed", rolled)
    prompt = random_prompts([9], seed=32)[0]
    (output,) = engine.generate([prompt], GREEDY)
    sample = output.samples[0]
    errors = _max_logprob_error(model, prompt, sample.token_ids, sample.logprobs)
    assert errors[0] < 1e-5
    assert min(errors[1:]) > 1e-4


def test_refit_and_sleep_update_the_absorbed_projections(mla_models):
    """The absorbed projections are views of kv_b_proj's storage: after a refit to other weights, and after
    sleep(level=2) (storage released and reallocated) and a reload, the engine follows the weights it holds."""
    _, model = mla_models["deepseek_v3"]
    other = build_hf_from_config(model.config, seed=33)
    engine = engine_from_hf(model)
    prompt = random_prompts([7], seed=34)[0]
    before = engine.generate([prompt], GREEDY)[0].samples[0].token_ids
    assert before == hf_greedy(model, prompt, NEW_TOKENS)
    for refit in ("in place", "after sleep"):
        if refit == "after sleep":
            engine.sleep(level=2)
            engine.wake_up()
        engine.load_weights(hub_weights(other))
        sample = engine.generate([prompt], GREEDY)[0].samples[0]
        assert sample.token_ids == hf_greedy(other, prompt, NEW_TOKENS)
        assert max(_max_logprob_error(other, prompt, sample.token_ids, sample.logprobs)) < 1e-5
    assert sample.token_ids != before


def test_the_config_reading_equals_transformers(mla_models):
    """Softmax scale (YaRN's mscale^2), the YaRN inverse frequencies and concentration, as transformers has them."""
    for name in MLA_MODELS:
        _, model = mla_models[name]
        cfg = read_spec(model.config)
        assert cfg.mla is not None
        assert cfg.softmax_scale == pytest.approx(model.model.layers[0].self_attn.scaling, rel=1e-12)
        rotary = model.model.rotary_emb
        assert torch.equal(rope_inv_freq(cfg.rope, cfg.rotary_dim), rotary.inv_freq)
        assert cfg.rope.attention_scaling == pytest.approx(rotary.attention_scaling, rel=1e-12)
        assert cfg.mla.rope_interleave is model.config.rope_interleave
    assert read_spec(mla_models["deepseek_v3"][1].config).rope.rope_type == "yarn"
    lite = read_spec(mla_models["glm4_moe_lite"][1].config)
    attention = mla_models["glm4_moe_lite"][1].model.layers[0].self_attn
    assert (lite.norm_epsilon, lite.latent_norm_eps) == (1e-5, attention.kv_a_layernorm.variance_epsilon)
    assert lite.latent_norm_eps == attention.q_a_layernorm.variance_epsilon == 1e-6


def test_kv_bytes_per_token_of_grouped_query_attention(get_hf_model):
    engine = engine_from_hf(get_hf_model("llama"))  # 2 layers, 2 KV heads of 16 dims
    engine.generate([[1, 2, 3]], GREEDY)
    assert engine.last_stats.kv_bytes_per_token == 2 * 2 * 2 * 16 * torch.float32.itemsize


def _dense_latent_reference(q_latent, q_rope, cache, tables, lengths, scale):
    """Each sequence's entries laid out contiguously; scores q_latent . c_kv + q_rope . k_pe, softmax and the
    weighted latents, in float64."""
    rank = q_latent.shape[-1]
    block = cache.shape[2]
    out = []
    for b in range(q_latent.shape[0]):
        slots = torch.cat([torch.arange(blk * block, blk * block + block) for blk in tables[b].tolist()])
        entries = cache[0, :, :, 0].reshape(-1, cache.shape[-1])[slots[: int(lengths[b])]].double()
        scores = q_latent[b].double() @ entries[:, :rank].T + q_rope[b].double() @ entries[:, rank:].T
        out.append(torch.softmax(scores * scale, dim=-1) @ entries[:, :rank])
    return torch.stack(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 3])
def test_triton_latent_kernel_matches_a_dense_reference(splits, dtype):
    """A rank and a rotary width that are not powers of two, 20 heads (a partly filled second block of 16), shared
    prompt blocks, partly filled last blocks and a padding row of the scratch block, split or not over the length;
    bf16 within the rounding of its inputs and probabilities (the interpreter truncates to bf16)."""
    rank, rope, heads, num_blocks, block = 24, 8, 20, 24, 4
    gen = torch.Generator().manual_seed(6)
    cache = torch.randn(1, num_blocks, block, 1, rank + rope, generator=gen).to(dtype)
    pad = SCRATCH_BLOCK
    tables = torch.tensor([[3, 7, 9, 11, pad], [3, 7, 12, pad, pad], [3, 7, 15, 2, 20], [5, 6, 8, 10, 13], [pad] * 5])
    lengths = torch.tensor([14, 9, 20, 17, 1])
    q_latent = torch.randn(5, heads, rank, generator=gen).to(dtype)
    q_rope = torch.randn(5, heads, rope, generator=gen).to(dtype)
    on = TRITON_DEVICE
    got = paged_mla_decode(*(t.to(on) for t in (q_latent, q_rope, cache, tables, lengths)), 0.3, splits=splits).cpu()
    assert got.dtype == dtype and got.shape == (5, heads, rank)
    expected = _dense_latent_reference(q_latent, q_rope, cache, tables, lengths, 0.3)
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_what_the_triton_latent_kernel_refuses(monkeypatch):
    """Queries that do not fit the cache, a cache that is not one latent head, rows that are not contiguous, a
    block size that is not a power of two, a CPU device outside the interpreter, Triton missing."""
    cache = torch.zeros(1, 4, 4, 1, 32)
    tables, lengths = torch.zeros(2, 2, dtype=torch.long), torch.ones(2, dtype=torch.long)
    q_latent, q_rope = torch.zeros(2, 16, 24), torch.zeros(2, 16, 8)
    with pytest.raises(ValueError, match="do not fit a latent cache"):
        paged_mla_decode(q_latent, torch.zeros(2, 16, 9), cache, tables, lengths, 1.0)
    with pytest.raises(ValueError, match="do not fit a latent cache"):
        paged_mla_decode(q_latent, q_rope, torch.zeros(1, 4, 4, 2, 32), tables, lengths, 1.0)
    with pytest.raises(ValueError, match="contiguous last dimension"):
        paged_mla_decode(torch.zeros(2, 24, 16).transpose(1, 2), q_rope, cache, tables, lengths, 1.0)
    with pytest.raises(ValueError, match="power-of-two block_size"):
        triton_mla.check_usable(torch.device("cuda"), 6)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="interpreter"):
        paged_mla_decode(q_latent, q_rope, cache, tables, lengths, 1.0)
    monkeypatch.setattr(triton_mla, "available", lambda: False)
    with pytest.raises(ValueError, match="needs Triton"):
        triton_mla.check_usable(torch.device("cuda"), 16)


def test_what_multi_latent_attention_refuses(mla_models):
    config = mla_models["deepseek_v3"][1].config
    with pytest.raises(ValueError, match="decode_attention='flex': multi-latent attention decodes through triton"):
        Engine(config, tiny_engine_config(decode_attention="flex"))
    with pytest.raises(NotImplementedError, match="kv_cache_dtype fp8"):
        Engine(config, tiny_engine_config(kv_cache_dtype="fp8"))
