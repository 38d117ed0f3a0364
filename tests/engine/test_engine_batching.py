"""Continuous batching, preemption and prefix sharing, each checked both by the scheduler's counters (the
mechanism really ran) and against transformers (the outputs stayed right)."""

from __future__ import annotations

import dataclasses

import pytest
from engine_helpers import engine_from_hf, hf_greedy, hf_token_logprobs, random_prompts

from hf_mcore_bridge.engine import SamplingParams
from hf_mcore_bridge.engine.attention import bytes_per_block
from hf_mcore_bridge.engine.kv_cache import blocks_for

BLOCK = 4


def _budget(engine_blocks: int) -> int:
    """KV bytes for `engine_blocks` blocks of the tiny llama/mistral (2 layers, 2 kv heads, head_dim 16, fp32)."""
    import torch

    return engine_blocks * bytes_per_block(2, BLOCK, 2, 16, torch.float32)


def test_more_sequences_than_slots_and_blocks(get_hf_model):
    """12 sequences through 4 slots and a cache too small for all: they wait, join as others finish, and
    some are preempted and recomputed; every output still equals transformers' greedy generate."""
    model = get_hf_model("llama")
    prompts = random_prompts([6, 9, 3, 14, 7, 5], seed=5)
    # 17 usable blocks: one sequence needs at most blocks_for(14 + 16) = 8; four need up to 8 + 3 * 6.
    engine = engine_from_hf(model, max_num_seqs=4, kv_cache_memory_bytes=_budget(18))
    outputs = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=16))
    stats = engine.last_stats
    assert stats.max_running == 4
    assert stats.joins_while_running > 0
    assert stats.waits_for_blocks > 0
    assert stats.preemptions > 0
    assert stats.peak_blocks_used <= engine.num_blocks - 1
    for prompt, output in zip(prompts, outputs, strict=True):
        reference = hf_greedy(model, prompt, 16)
        for sample in output.samples:
            assert sample.token_ids == reference
            assert sample.logprobs == pytest.approx(hf_token_logprobs(model, prompt, reference, 1.0), abs=1e-5)


def test_sampling_is_unchanged_by_batching_and_preemption(get_hf_model):
    """Counter-based sampling: the same seed gives the same samples in a roomy engine and in one that must
    queue and preempt; and the log-probs are transformers' under either schedule."""
    model = get_hf_model("mistral")
    prompts = random_prompts([6, 12, 4, 9], seed=6)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=14, seed=77)
    roomy = engine_from_hf(model, max_num_seqs=16).generate(prompts, params)
    tight_engine = engine_from_hf(model, max_num_seqs=3, max_model_len=32, kv_cache_memory_bytes=_budget(14))
    tight = tight_engine.generate(prompts, params)
    assert tight_engine.last_stats.preemptions > 0
    for prompt, a, b in zip(prompts, roomy, tight, strict=True):
        for sa, sb in zip(a.samples, b.samples, strict=True):
            assert sa.token_ids == sb.token_ids
            assert sb.logprobs == pytest.approx(hf_token_logprobs(model, prompt, sb.token_ids, 1.0), abs=1e-5)


def test_samples_of_a_prompt_share_its_blocks(get_hf_model):
    """n=4 samples: the prompt is prefilled once, its full blocks are shared, its partial last block is copied
    on write by all but one sample; the samples' log-probs prove no sample saw another's tokens."""
    model = get_hf_model("qwen2")
    prompt = random_prompts([10], seed=7)[0]  # 2 full blocks + a half-filled third
    n, new = 4, 8
    engine = engine_from_hf(model)
    (output,) = engine.generate([prompt], SamplingParams(n=n, temperature=1.0, max_tokens=new, seed=5))
    stats = engine.last_stats
    prompt_blocks = blocks_for(len(prompt), BLOCK)
    total_blocks = blocks_for(len(prompt) + new - 1, BLOCK)  # the last sampled token is never written
    assert stats.prefill_tokens == len(prompt)
    assert stats.cow_copies == n - 1
    assert stats.blocks_allocated == prompt_blocks + (n - 1) + n * (total_blocks - prompt_blocks)
    assert stats.blocks_allocated < n * total_blocks
    assert len({tuple(s.token_ids) for s in output.samples}) > 1
    for sample in output.samples:
        assert sample.logprobs == pytest.approx(hf_token_logprobs(model, prompt, sample.token_ids, 1.0), abs=1e-5)


@pytest.mark.parametrize("kernel", [{}, {"decode_attention": "flex", "flex_min_batch": 6}])
def test_pipelined_decode_discards_the_step_after_a_stop(get_hf_model, kernel):
    """Decode steps are launched before the previous step's tokens reach the host, so a sample that draws a stop
    token has already been decoded once more: that token must vanish. Each stopped sample equals the same sample
    drawn without the stop token (counter-based sampling), cut right after its first stop token. With FlexAttention
    above 6 rows, the batch shrinks across the switch to the gather kernel as samples stop."""
    model = get_hf_model("llama")
    prompts = random_prompts([6, 11], seed=8)
    free = SamplingParams(n=6, temperature=1.5, max_tokens=24, seed=5)
    free_outputs = engine_from_hf(model).generate(prompts, free)
    # a token the free-running samples draw somewhere in their middle
    middle = [t for o in free_outputs for s in o.samples for t in s.token_ids[2:-2]]
    stop = max(set(middle), key=middle.count)
    engine = engine_from_hf(model, max_num_seqs=12, **kernel)
    stopped = engine.generate(prompts, dataclasses.replace(free, stop_token_ids=(stop,)))
    stats = engine.last_stats
    assert stats.pipelined_steps > 0 and stats.discarded_tokens > 0
    finished = []
    for a, b in zip(free_outputs, stopped, strict=True):
        for sa, sb in zip(a.samples, b.samples, strict=True):
            cut = sa.token_ids.index(stop) + 1 if stop in sa.token_ids else len(sa.token_ids)
            assert sb.token_ids == sa.token_ids[:cut]
            assert sb.logprobs == pytest.approx(sa.logprobs[:cut], abs=1e-6)
            finished.append(sb.finish_reason)
    assert "stop" in finished and "length" in finished


def test_on_sample_hands_over_each_sample_as_it_finishes(get_hf_model):
    """`generate(on_sample=...)`: every sample once, as the very output returned for it, with its prompt's
    position; all admitted together, so they finish (and are handed over) in order of length, which the prompt
    order is not (the check could fail). Under queueing and preemption every sample is still handed over once
    and the outputs are those of a call without the callback."""
    model = get_hf_model("llama")
    prompts = random_prompts([5, 8, 3], seed=11)
    # a third of the vocabulary stops a sample: lengths from 1 to max_tokens
    params = SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=3, stop_token_ids=list(range(0, 211, 3)))
    engine = engine_from_hf(model, max_num_seqs=16)
    handed: list[tuple[int, object]] = []
    outputs = engine.generate(prompts, params, on_sample=lambda i, sample: handed.append((i, sample)))
    assert engine.last_stats.joins_while_running == 0  # one admission: finishing order is length order
    assert sorted((i, s.index) for i, s in handed) == [(i, s) for i in range(3) for s in range(4)]
    assert all(sample is outputs[i].samples[sample.index] for i, sample in handed)
    lengths = [len(sample.token_ids) for _, sample in handed]
    assert lengths == sorted(lengths)
    in_prompt_order = [len(s.token_ids) for out in outputs for s in out.samples]
    assert in_prompt_order != sorted(in_prompt_order) and len(set(lengths)) > 2

    params = dataclasses.replace(params, stop_token_ids=list(range(0, 211, 7)))  # longer: blocks run short
    tight = engine_from_hf(model, max_num_seqs=8, max_model_len=32, kv_cache_memory_bytes=_budget(14))
    handed.clear()
    queued = tight.generate(prompts, params, first_index=5, on_sample=lambda i, sample: handed.append((i, sample)))
    assert tight.last_stats.joins_while_running > 0 and tight.last_stats.preemptions > 0
    assert sorted((i, s.index) for i, s in handed) == [(i, s) for i in range(3) for s in range(4)]
    assert all(sample is queued[i].samples[sample.index] for i, sample in handed)
    plain = engine_from_hf(model, max_num_seqs=16).generate(prompts, params, first_index=5)
    assert [[s.token_ids for s in out.samples] for out in queued] == [[s.token_ids for s in o.samples] for o in plain]
