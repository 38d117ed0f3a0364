"""Scoring overlapped with generation (`reward.overlap`): the trainer's `_generate_scored` with an engine that
finishes its samples over time, in an order of its own, and rewards whose calls are timed from outside the
workers.

The rewards must be the reward function's own values (called here in-process), in sample order, with or without
the overlap; with it the first score is taken while the engine is still generating, without it only after (the
same check failing there shows it can fail); a reward that runs out of time scores 0 and is counted, and one
that raises stops the batch with the error naming its sample.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hf_mcore_bridge.engine.engine import RequestOutput, SampleOutput
from hf_mcore_bridge.grpo.data.scoring import RewardScorer, ScoreResult
from hf_mcore_bridge.grpo.run.trainer import _generate_scored

from .. import reward_fns

TEXTS = [["alpha", "be"], ["gamma", "delta!"], ["e", "zeta zeta"]]
"""Each prompt's completions, in sample order."""
ANSWERS = ["1", "22", "333"]


class _SlowEngine:
    """Stands in for the embedded engine: finishes one sample every `every_s` seconds, the last prompt's last
    sample first (a real engine's order is that of finishing, not of prompts), handing each to `on_sample`."""

    def __init__(self, texts: list[list[str]], every_s: float) -> None:
        self.texts, self.every_s, self.ended = texts, every_s, 0.0

    def generate(self, prompts: Any, params: Any, on_sample: Any = None) -> list[RequestOutput]:
        samples = [[SampleOutput(s, [1], text, "stop", None) for s, text in enumerate(g)] for g in self.texts]
        for i in reversed(range(len(samples))):
            for sample in reversed(samples[i]):
                time.sleep(self.every_s)
                if on_sample is not None:
                    on_sample(i, sample)
        self.ended = time.time()
        return [RequestOutput([0], group) for group in samples]


def _run(scorer: RewardScorer, engine: _SlowEngine, overlap: bool) -> tuple[ScoreResult, list[Any]]:
    ctx = SimpleNamespace(
        replicas=SimpleNamespace(tp_rank=0),
        config=SimpleNamespace(reward=SimpleNamespace(overlap=overlap)),
        engine=engine,
        scorer=scorer,
    )
    answers = [a for a, group in zip(ANSWERS, engine.texts, strict=True) for _ in group]
    outputs, scored, _ = _generate_scored(ctx, [[0]] * len(engine.texts), SimpleNamespace(n=2), answers)  # type: ignore[arg-type]
    assert scored is not None
    return scored, outputs


def test_scores_are_taken_while_generating_and_equal_those_after_it(tmp_path: Path, monkeypatch) -> None:
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("REWARD_CALLS", str(calls))  # before the workers start: they inherit it
    flat = [(text, answer) for group, answer in zip(TEXTS, ANSWERS, strict=True) for text in group]
    expected = [float(len(text) + len(answer)) for text, answer in flat]  # the reward's own rule, written here

    def first_call() -> float:
        ours = {text for text, _ in flat}
        return min(
            float(t) for t, _, text in (line.partition(" ") for line in calls.read_text().splitlines()) if text in ours
        )

    with RewardScorer(reward_fns.recorded_length, num_workers=2, timeout_s=5.0) as scorer:
        scorer.score(["warm"], [""])  # the workers are up
        for overlap in (True, False):
            calls.write_text("")
            engine = _SlowEngine(TEXTS, every_s=0.4)
            scored, outputs = _run(scorer, engine, overlap)
            assert scored == ScoreResult(expected, 0)
            assert [s.text for out in outputs for s in out.samples] == [text for text, _ in flat]
            if overlap:  # the first sample finished 2 s before the engine returned
                assert first_call() < engine.ended
            else:
                assert first_call() > engine.ended


def test_a_slow_or_failing_reward_while_generating() -> None:
    """A sample past `timeout_s` scores 0 and is counted; a reward that raises ends the batch (and the engine's
    call) with an error naming the sample, and the scorer's next batch is scored by fresh workers."""
    with RewardScorer(reward_fns.fails_on_bad_slow_on_slow, num_workers=1, timeout_s=0.5, grace_s=2.0) as scorer:
        slow = [["ok", "ok"], ["slow", "ok"], ["ok", "ok"]]
        scored, _ = _run(scorer, _SlowEngine(slow, every_s=0.05), overlap=True)
        assert scored == ScoreResult([1.0, 1.0, 0.0, 1.0, 1.0, 1.0], 1)
        bad = [["ok", "ok"], ["ok", "bad"], ["ok", "ok"]]
        with pytest.raises(RuntimeError, match=r"sample 3: ValueError: cannot read this answer"):
            _run(scorer, _SlowEngine(bad, every_s=0.3), overlap=True)
        assert scorer.score(["ok"], [""]) == ScoreResult([1.0], 0)
