"""The CUDA-graph runner's bucketing and padding, on CPU: the runner is driven with an eager 'replay' (the one
thing a CPU cannot do is the capture itself), so padded rows and padded block tables must leave the real rows'
outputs exactly as transformers computes them."""

from __future__ import annotations

import gc
import weakref

import pytest
from engine_helpers import engine_from_hf, hf_greedy, hf_token_logprobs, random_prompts

from hf_mcore_bridge.engine import SamplingParams
from hf_mcore_bridge.engine import model as model_module
from hf_mcore_bridge.engine.attention import with_block_mask
from hf_mcore_bridge.engine.cuda_graphs import DecodeGraphs, batch_bucket, block_bucket


class EagerReplay:
    """Stands in for a captured graph: re-runs the decode function on the static inputs into the static logits."""

    def __init__(self, graphs: DecodeGraphs, ids, positions, meta, logits) -> None:
        self.graphs, self.args, self.logits = graphs, (ids, positions, meta), logits

    def replay(self) -> None:
        self.logits.copy_(self.graphs.decode_fn(*self.args))


class EagerGraphs(DecodeGraphs):
    def _record(self, ids, positions, meta):
        logits = self.decode_fn(ids, positions, meta)
        return EagerReplay(self, ids, positions, meta, logits), logits


def test_buckets_round_up():
    assert [batch_bucket(b, 512) for b in (1, 3, 5, 8, 9, 17, 128, 129, 500)] == [1, 4, 8, 8, 16, 32, 128, 192, 512]
    assert batch_bucket(300, 256) == 256
    assert [block_bucket(n, 40, 4) for n in (1, 4, 5, 39)] == [4, 4, 8, 40]


def test_padded_decode_buckets_leave_real_rows_exact(get_hf_model):
    model = get_hf_model("qwen3")
    engine = engine_from_hf(model, max_num_seqs=16)
    engine._graphs = EagerGraphs(engine._decode_forward, engine.device, 16, engine.max_blocks_per_seq, 4)
    prompts = random_prompts([3, 9, 17], seed=14)  # 6 and then fewer rows: buckets of 8, 4, ...
    params = [
        SamplingParams(n=2, temperature=0.0, max_tokens=14),
        SamplingParams(n=2, temperature=0.0, max_tokens=7),
        SamplingParams(n=2, temperature=0.9, max_tokens=10, seed=1),
    ]
    outputs = engine.generate(prompts, params)
    assert engine._graphs.num_captured >= 3
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        for sample in output.samples:
            if p.temperature == 0:
                assert sample.token_ids == hf_greedy(model, prompt, p.max_tokens)
            expected = hf_token_logprobs(model, prompt, sample.token_ids, p.temperature)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)


def test_flex_buckets_use_full_width_tables_and_small_ones_gather(get_hf_model, monkeypatch):
    """With FlexAttention for buckets of at least 4 rows: those buckets are captured with full-width block tables
    (one compilation per bucket), smaller ones with bucketed widths and the gather kernel; every real row's output
    is still transformers'."""
    model = get_hf_model("llama")
    engine = engine_from_hf(model, max_num_seqs=16, decode_attention="flex", flex_min_batch=4)
    graphs = EagerGraphs(engine._decode_forward, engine.device, 16, engine.max_blocks_per_seq, 4, full_width_rows=4)
    engine._graphs = graphs
    flex_rows: list[int] = []

    def spy(meta, block_size, num_blocks):
        flex_rows.append(meta.block_tables.shape[0])
        return with_block_mask(meta, block_size, num_blocks)

    monkeypatch.setattr(model_module, "with_block_mask", spy)
    prompts = random_prompts([3, 9, 17], seed=15)
    params = [SamplingParams(n=2, temperature=0.0, max_tokens=t) for t in (14, 7, 3)]  # 6 rows, then 4, then 2
    outputs = engine.generate(prompts, params)
    shapes = set(graphs._graphs)
    assert {rows for rows, _ in shapes} >= {8, 2}
    assert all(width == engine.max_blocks_per_seq for rows, width in shapes if rows >= 4)
    assert any(width < engine.max_blocks_per_seq for rows, width in shapes if rows < 4)
    assert flex_rows and min(flex_rows) >= 4  # FlexAttention ran, and only for the large buckets
    for prompt, p, output in zip(prompts, params, outputs, strict=True):
        for sample in output.samples:
            assert sample.token_ids == hf_greedy(model, prompt, p.max_tokens)
            expected = hf_token_logprobs(model, prompt, sample.token_ids, 1.0)
            assert sample.logprobs == pytest.approx(expected, abs=1e-5)


def test_an_engine_with_its_graph_runner_is_freed_when_dropped(get_hf_model):
    """The runner reaches the engine through a weak reference: no cycle, so dropping the engine frees it (and its
    GPU memory) at once, without the garbage collector."""
    engine = engine_from_hf(get_hf_model("llama"))
    engine._graphs = engine._decode_graphs()  # built only on CUDA, but constructible anywhere
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None
    finally:
        gc.enable()
