"""The engine on hybrid models (Gated DeltaNet layers beside gated full attention: Qwen3.5, Qwen3.5 MoE, Qwen3-Next
with its fused projections) against transformers: greedy tokens equal to `generate` and log-probs within 1e-5 of a
forward pass, for prompts of different lengths (one longer than a chunk of the chunked delta rule), several sequences
in a batch and n samples of one prompt (which start from copies of the prompt's states), through preemption, and
after sleep / wake_up. The tiny models are the registry's (8 layers: 6 linear, 2 full attention), float32 on the
CPU."""

from __future__ import annotations

import pytest
import torch
from engine_helpers import (
    build_hybrid_model,
    hf_greedy,
    hf_token_logprobs,
    hub_weights,
    random_prompts,
    tiny_engine_config,
)
from transformers import PreTrainedModel

from hf_mcore_bridge.engine import Engine, SamplingParams, read_spec
from hf_mcore_bridge.engine.attention import bytes_per_block
from hf_mcore_bridge.models.tiny_models import tiny_config

LENGTHS = [5, 11, 70]  # 70: past the chunked delta rule's 64-token chunk
ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM")


_MODELS: dict[str, PreTrainedModel] = {}


@pytest.fixture(params=ARCHS)
def any_model(request: pytest.FixtureRequest) -> PreTrainedModel:
    """Each hybrid architecture's tiny model (built once per module run)."""
    if request.param not in _MODELS:
        _MODELS[request.param] = build_hybrid_model(request.param)
    return _MODELS[request.param]


@pytest.fixture
def model() -> PreTrainedModel:
    """Qwen3.5's tiny model."""
    if ARCHS[0] not in _MODELS:
        _MODELS[ARCHS[0]] = build_hybrid_model(ARCHS[0])
    return _MODELS[ARCHS[0]]


def state_bytes(model: PreTrainedModel) -> int:
    """One sequence's float32 states over the linear layers, from the config: conv windows of q, k and v, and the
    delta rule's [v_heads, dk, dv] matrix."""
    c = model.config
    linear = sum(kind == "linear_attention" for kind in c.layer_types)
    conv = (2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim) * (
        c.linear_conv_kernel_dim - 1
    )
    recurrent = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
    return linear * (conv + recurrent) * 4


def engine(model: PreTrainedModel, **overrides: object) -> Engine:
    settings = dict(max_model_len=128, kv_cache_memory_bytes=1 << 20)
    runner = Engine(model.config, tiny_engine_config(**{**settings, **overrides}))
    runner.load_weights(hub_weights(model))
    return runner


LONG_TOL = 2e-5
"""Log-prob tolerance after the 70-token prompt or 30-token sequences (1e-5 elsewhere). Float32 rounding over a long
recurrence on the tiny random models, measured against transformers in float64: after the 70-token prompt Qwen3.5
MoE's engine is 1.2e-5 off (5.9e-6 with the chunked delta rule in float64, 9.0e-6 with a token-by-token recurrence
in its place), transformers' float32 forward 4.1e-6; on 30-token sequences transformers' own cached decode differs
from its forward by up to 8e-6."""


MOE_TOL = 5e-5
"""Log-prob tolerance of the mixture-of-experts variants at temperature 0.7: on their tiny random models float32
itself is that coarse there, measured against transformers in float64 over `test_sampled_logprobs_...`'s samples:
transformers' float32 forward 2.1e-5 (Qwen3.5 MoE) and 2.2e-5 (Qwen3-Next) off, the engine 2.6e-5 and 2.4e-5."""


def check_greedy(
    model: PreTrainedModel, prompts: list[list[int]], outputs: list, max_tokens: int, tol: float = 1e-5
) -> None:
    """Every sample's tokens are transformers' greedy ones and its log-probs those of a transformers forward pass
    (within `tol`; `LONG_TOL` after a prompt longer than a delta-rule chunk)."""
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, max_tokens)
        expected = hf_token_logprobs(model, prompt, reference, temperature=1.0)
        for sample in output.samples:
            assert sample.token_ids == reference
            assert sample.logprobs == pytest.approx(expected, abs=LONG_TOL if len(prompt) > 64 else tol)


def test_greedy_matches_transformers_generate(any_model):
    model = any_model
    runner = engine(model)
    prompts = random_prompts(LENGTHS, seed=1)
    outputs = runner.generate(prompts, SamplingParams(n=3, temperature=0.0, max_tokens=10))
    check_greedy(model, prompts, outputs, 10)
    stats = runner.last_stats
    assert stats.state_bytes_per_sequence == state_bytes(model)
    c = model.config
    full = sum(kind == "full_attention" for kind in c.layer_types)
    assert stats.kv_bytes_per_token == full * 2 * c.num_key_value_heads * c.head_dim * 4  # attention layers only


def test_padded_decode_rows_run_in_the_scratch_state_slot(model):
    """Decode rows padded to a batch bucket, as CUDA graphs run them (forced on the CPU through the padded eager
    path): 5 sequences in 8 rows, the 3 padded ones reading and writing the scratch slot only."""
    runner = engine(model)
    runner._flex_rows = 1  # pad every decode step to its batch bucket
    prompts = random_prompts([5, 9, 4, 12, 7], seed=8)
    check_greedy(model, prompts, runner.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8)), 8)


def test_sampled_logprobs_match_transformers_forward(any_model):
    model = any_model
    runner = engine(model)
    prompts = random_prompts([7, 16], seed=2)
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, max_tokens=10, seed=123)
    distinct = set()
    for prompt, output in zip(prompts, runner.generate(prompts, params), strict=True):
        for sample in output.samples:
            distinct.add(tuple(sample.token_ids))
            expected = hf_token_logprobs(model, prompt, sample.token_ids, temperature=0.7)
            assert sample.logprobs == pytest.approx(expected, abs=MOE_TOL if runner.model_config.moe else 1e-5)
    assert len(distinct) > 2


def test_preempted_sequences_recompute_their_states(model):
    """4 sequence slots and 17 usable blocks for 12 sequences: some are preempted and recomputed in fresh state
    slots; every output still equals transformers' greedy tokens, and its log-probs its forward's (`LONG_TOL`)."""
    prompts = random_prompts([6, 9, 3, 14, 7, 5], seed=5)
    c = model.config
    full = sum(kind == "full_attention" for kind in c.layer_types)
    budget = 5 * state_bytes(model) + 18 * bytes_per_block(full, 4, c.num_key_value_heads, c.head_dim, torch.float32)
    runner = engine(model, max_num_seqs=4, max_model_len=64, kv_cache_memory_bytes=budget)
    assert runner.num_blocks == 18
    outputs = runner.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=16))
    assert runner.last_stats.preemptions > 0
    assert runner.last_stats.joins_while_running > 0
    check_greedy(model, prompts, outputs, 16, tol=LONG_TOL)


def test_states_survive_sleep_and_a_reload(any_model):
    """Reloaded from transformers' in-memory names (a MoE model's fused experts)."""
    model = any_model
    runner = engine(model)
    prompts = random_prompts([9, 4], seed=4)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=6)
    runner.sleep(level=2)
    assert runner.states is None and runner.kv_cache is None
    runner.wake_up()
    runner.load_weights(model.named_parameters())
    check_greedy(model, prompts, runner.generate(prompts, params), 6)


def test_a_budget_the_states_leave_too_little_of_is_refused_naming_both(model):
    states = 9 * state_bytes(model)  # max_num_seqs 8, plus the scratch slot
    with pytest.raises(
        ValueError, match=rf"leaves 100 bytes after the Gated DeltaNet states \(9 slots x \d+ = {states}"
    ):
        Engine(model.config, tiny_engine_config(kv_cache_memory_bytes=states + 100))


def test_gated_delta_net_with_another_activation_is_refused_by_name():
    config = {**tiny_config(ARCHS[0]), "hidden_act": "gelu_pytorch_tanh"}  # an activation the dense MLPs take
    with pytest.raises(NotImplementedError, match=r"^Qwen3_5ForCausalLM: Gated DeltaNet is implemented with "):
        read_spec(config)
