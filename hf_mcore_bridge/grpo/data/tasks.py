"""Built-in prompt/answer tasks, generated from a seed with no download.

They exist to exercise GRPO end to end on a tiny, randomly initialised policy: every prompt ends in "Answer:" and
every answer is one or two digits, so an untrained model emits the right answer now and then, rewards are not
all zero, and group advantages carry a signal from the first step. They test the training machinery, not
reasoning. The reward for them is `number` (`rewards.math_reward`), which reads a completion without a marker as a
bare answer (its first word).

Each generator maps a `random.Random` to one record; `generate_records` draws records one after another from a
generator seeded with `seed`, so the first `k` of `n` records do not depend on `n`. Integers come from
`random()` only, the part of the standard library's generator whose output per seed Python keeps stable across
versions (`randrange` and `choice` may change).
"""

import difflib
import functools
import random
from collections.abc import Callable

from hf_mcore_bridge.grpo.data.records import PromptRecord

__all__ = [
    "TASKS",
    "TaskGenerator",
    "arithmetic",
    "count_digits",
    "generate_records",
    "last_digit",
    "repeat_digit",
]

TaskGenerator = Callable[[random.Random], PromptRecord]


def _uniform_int(rng: random.Random, low: int, high: int) -> int:
    """Uniform integer in [low, high]."""
    return low + min(int(rng.random() * (high - low + 1)), high - low)


def arithmetic(rng: random.Random, max_operand: int = 9) -> PromptRecord:
    """`What is a + b?` or `What is a - b?` with operands in [0, max_operand] and a non-negative result."""
    a, b = _uniform_int(rng, 0, max_operand), _uniform_int(rng, 0, max_operand)
    if rng.random() < 0.5:
        return PromptRecord(prompt=f"What is {a} + {b}? Answer:", answer=str(a + b))
    a, b = max(a, b), min(a, b)
    return PromptRecord(prompt=f"What is {a} - {b}? Answer:", answer=str(a - b))


def repeat_digit(rng: random.Random) -> PromptRecord:
    """`Repeat the digit d.` with d in 0-9; the answer is d."""
    digit = _uniform_int(rng, 0, 9)
    return PromptRecord(prompt=f"Repeat the digit {digit}. Answer:", answer=str(digit))


def last_digit(rng: random.Random, max_digits: int = 4) -> PromptRecord:
    """`What is the last digit of n?` for n of 2 to `max_digits` digits; the answer is n mod 10."""
    number = _uniform_int(rng, 10, 10**max_digits - 1)
    return PromptRecord(prompt=f"What is the last digit of {number}? Answer:", answer=str(number % 10))


def count_digits(rng: random.Random, max_digits: int = 6) -> PromptRecord:
    """`How many digits does n have?` for n of 1 to `max_digits` digits (each length equally likely)."""
    length = _uniform_int(rng, 1, max_digits)
    number = _uniform_int(rng, 10 ** (length - 1) if length > 1 else 0, 10**length - 1)
    return PromptRecord(prompt=f"How many digits does {number} have? Answer:", answer=str(length))


TASKS: dict[str, TaskGenerator] = {
    "arithmetic": arithmetic,
    "arithmetic_2digit": functools.partial(arithmetic, max_operand=49),
    "repeat_digit": repeat_digit,
    "last_digit": last_digit,
    "count_digits": count_digits,
}


def _lookup(task: str) -> TaskGenerator:
    if task in TASKS:
        return TASKS[task]
    close = difflib.get_close_matches(task, TASKS, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise ValueError(f"unknown task {task!r}: built-in tasks are {sorted(TASKS)}{hint}")


def generate_records(task: str | TaskGenerator, num_records: int, seed: int = 0) -> list[PromptRecord]:
    """`num_records` records of a built-in task (by name) or of any generator, reproducible from `seed`."""
    if num_records < 0:
        raise ValueError(f"num_records must be >= 0, got {num_records}")
    generator = _lookup(task) if isinstance(task, str) else task
    rng = random.Random(seed)
    return [generator(rng) for _ in range(num_records)]
