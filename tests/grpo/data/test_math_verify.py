r"""The `math` reward (Hugging Face's math-verify) on a table of tricky pairs, and the scorer's worker pool and time
limits.

The expected values are mathematics written here, not the library's output: equal values in other notations
score 1, values that merely look close score 0.
"""

import time

import pytest

from hf_mcore_bridge.grpo.data.rewards import math_reward, math_verify_reward
from hf_mcore_bridge.grpo.data.scoring import RewardScorer, ScoreResult, score_with_time_limit

from .. import reward_fns

TRICKY = [
    # fractions and decimals
    (r"The answer is $\boxed{\frac{1}{2}}$.", "0.5", 1.0),
    (r"\boxed{0.5}", r"\frac12", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{2}{4}}", "0.5", 1.0),
    (r"\boxed{1.5}", r"\frac32", 1.0),
    (r"\boxed{0.333}", r"\frac13", 0.0),
    (r"\boxed{2}", r"\frac{1}{2}", 0.0),
    (r"\boxed{-0.5}", "0.5", 0.0),
    # percentages
    (r"\boxed{50\%}", "0.5", 1.0),
    (r"\boxed{10\%}", "0.1", 1.0),
    # intervals and sets
    (r"\boxed{[1,2)}", "[1,2)", 1.0),
    (r"\boxed{(1,2]}", "[1,2)", 0.0),
    (r"\boxed{\{1,2\}}", r"\{2,1\}", 1.0),
    # expressions and radicals
    (r"\boxed{1+x}", "x+1", 1.0),
    (r"\boxed{x^2}", "x^{2}", 1.0),
    (r"\boxed{x+2}", "x+1", 0.0),
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}", 1.0),
    (r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt2}{2}", 1.0),
    (r"\boxed{3.14}", r"\pi", 0.0),
    # units and currency
    (r"\boxed{5\text{ cm}}", "5", 1.0),
    (r"\boxed{\$5}", "5", 1.0),
    # plain text and GSM8K references
    ("so she has 1,234 apples", "1234", 1.0),
    ("Natalia sold 48 clips.\n#### 72", "#### 72", 1.0),
    (r"\boxed{10}", "100", 0.0),
    (r"first \boxed{3}, finally \boxed{4}", "4", 1.0),
    ("I cannot solve this.", "4", 0.0),
    ("", "4", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), TRICKY)
def test_math_verify_reward_tricky_pairs(completion: str, answer: str, expected: float) -> None:
    assert math_verify_reward(completion, answer) == expected


def test_number_reward_is_not_symbolic() -> None:
    """Where the two readers part: the hand-written `number` reward cannot see these equalities."""
    assert math_reward(r"\boxed{1+x}", "x+1") == 0.0 and math_verify_reward(r"\boxed{1+x}", "x+1") == 1.0
    assert math_reward(r"\boxed{\sqrt{2}/2}", r"\frac{\sqrt2}{2}") == 0.0


def test_scorer_pool_matches_in_process_and_limits_pathological_answer() -> None:
    """Two workers score the table as the reward does in-process, the samples handed over last first while the
    caller is busy (a batch's feeding thread at work); `9^{9^{9^{9}}}` (an integer power in C that no signal
    interrupts), handed over first, runs out of its 1 s while the caller is still busy: its worker is killed then
    and replaced once `result()` takes over, and it scores 0 without holding the batch."""
    completions = [c for c, _, _ in TRICKY] + [r"\boxed{9^{9^{9^{9}}}}"]
    answers = [a for _, a, _ in TRICKY] + ["1"]
    with RewardScorer(math_verify_reward, num_workers=2, timeout_s=1.0, grace_s=1.0) as scorer:
        scorer.score(["1"], ["1"])  # workers started and warm
        started = time.perf_counter()
        with scorer.start(len(completions)) as batch:
            for index in reversed(range(len(completions))):
                batch.submit(index, completions[index], answers[index])
                if index == len(completions) - 1:
                    time.sleep(2.5)  # past its limit and the grace
                    assert len(scorer._workers) == 1  # killed by the feeding thread, not yet replaced
            result = batch.result()
        elapsed = time.perf_counter() - started
        assert len(scorer._workers) == 2
    assert result.rewards == [e for _, _, e in TRICKY] + [0.0]
    assert result.timeouts == 1
    assert elapsed < 20, elapsed


def test_time_limit_in_process() -> None:
    started = time.perf_counter()
    assert score_with_time_limit(reward_fns.slow_unless_ok, "slow", "", 0.2) is None
    assert score_with_time_limit(reward_fns.slow_unless_ok, "ok", "", 0.2) == 1.0
    assert time.perf_counter() - started < 5
    scorer = RewardScorer(reward_fns.slow_unless_ok, num_workers=0, timeout_s=0.2)
    assert scorer.score(["ok", "slow", "ok"], ["", "", ""]) == ScoreResult([1.0, 0.0, 1.0], 1)
    assert scorer.score(["ok", "slow"], ["", ""]).timeouts == 1


def test_stuck_worker_is_killed_at_the_deadline() -> None:
    """A call that blocks the timer's signal is ended by the batch deadline; the next batch gets a new pool."""
    scorer = RewardScorer(reward_fns.stuck_unless_ok, num_workers=1, timeout_s=0.2, grace_s=2.0)
    try:
        assert scorer.score(["ok"], [""]).rewards == [1.0]  # the worker is up
        started = time.perf_counter()
        result = scorer.score(["ok", "stuck"], ["", ""])
        assert time.perf_counter() - started < 15
        assert result.timeouts == 1 and result.rewards == [1.0, 0.0]
        assert scorer.score(["ok"], [""]).rewards == [1.0]
    finally:
        scorer.close()


def test_scorer_refuses_bad_values_and_lengths() -> None:
    scorer = RewardScorer(reward_fns.not_a_number, num_workers=0)
    with pytest.raises(TypeError, match="sample 0"):
        scorer.score(["a"], ["b"])
    with pytest.raises(ValueError, match="2 completions but 1 answers"):
        scorer.score(["a", "b"], ["c"])


def test_a_batch_takes_each_sample_once() -> None:
    scorer = RewardScorer(math_reward, num_workers=0)
    with scorer.start(3) as batch:
        batch.submit(2, "7", "7")
        with pytest.raises(ValueError, match="sample 2 was submitted twice"):
            batch.submit(2, "7", "7")
        with pytest.raises(IndexError, match="sample 3 is outside"):
            batch.submit(3, "7", "7")
        with pytest.raises(RuntimeError, match="a scoring batch is open"):
            scorer.start(1)
        with pytest.raises(ValueError, match="2 of the batch's 3 samples were never submitted"):
            batch.result()
    with scorer.start(2) as batch:
        batch.submit(1, "7", "7")
        batch.submit(0, "8", "7")
        assert batch.result() == ScoreResult([0.0, 1.0], 0)
