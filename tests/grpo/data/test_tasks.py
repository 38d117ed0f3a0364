"""Built-in tasks: answers checked by re-deriving them from the prompt text, seeding and shape of the answers."""

import random
import re

import pytest

from hf_mcore_bridge.grpo.data.records import PromptRecord
from hf_mcore_bridge.grpo.data.rewards import math_reward
from hf_mcore_bridge.grpo.data.tasks import TASKS, generate_records


def solve(prompt: str) -> str:
    """Answer a built-in prompt from its text alone, independently of the generators."""
    if match := re.fullmatch(r"What is (\d+) ([+-]) (\d+)\? Answer:", prompt):
        a, op, b = int(match[1]), match[2], int(match[3])
        return str(a + b if op == "+" else a - b)
    if match := re.fullmatch(r"Repeat the digit (\d)\. Answer:", prompt):
        return match[1]
    if match := re.fullmatch(r"What is the last digit of (\d+)\? Answer:", prompt):
        return match[1][-1]
    if match := re.fullmatch(r"How many digits does (\d+) have\? Answer:", prompt):
        return str(len(match[1]))
    raise AssertionError(f"unrecognised prompt {prompt!r}")


@pytest.mark.parametrize("task", sorted(TASKS))
def test_answers_are_correct_short_and_rewarded(task: str) -> None:
    records = generate_records(task, 300, seed=3)
    assert len(records) == 300
    for record in records:
        assert record["prompt"].endswith("Answer:")
        assert record["answer"] == solve(record["prompt"])
        assert 1 <= len(record["answer"]) <= 2 and record["answer"].isdigit()
        assert math_reward(" " + record["answer"], record["answer"]) == 1.0
    # Enough variety that a policy cannot score by always giving one answer.
    assert len({record["answer"] for record in records}) >= 5 or task == "count_digits"


def test_arithmetic_uses_both_operations_and_stays_non_negative() -> None:
    prompts = [record["prompt"] for record in generate_records("arithmetic", 200, seed=0)]
    assert any(" + " in prompt for prompt in prompts) and any(" - " in prompt for prompt in prompts)
    assert all(int(solve(prompt)) >= 0 for prompt in prompts)


def test_count_digits_covers_every_length() -> None:
    answers = {record["answer"] for record in generate_records("count_digits", 300, seed=0)}
    assert answers == {"1", "2", "3", "4", "5", "6"}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_seeded_and_prefix_stable(task: str) -> None:
    first = generate_records(task, 50, seed=7)
    assert generate_records(task, 50, seed=7) == first
    assert generate_records(task, 20, seed=7) == first[:20]
    assert generate_records(task, 50, seed=8) != first


def test_custom_generator() -> None:
    def constant(rng: random.Random) -> PromptRecord:
        return PromptRecord(prompt=f"{rng.random():.3f}", answer="1")

    records = generate_records(constant, 3, seed=1)
    assert [record["answer"] for record in records] == ["1", "1", "1"]
    assert len({record["prompt"] for record in records}) == 3


def test_unknown_task() -> None:
    with pytest.raises(ValueError, match="did you mean 'last_digit'"):
        generate_records("last_digits", 1)
    with pytest.raises(ValueError, match="num_records"):
        generate_records("arithmetic", -1)
