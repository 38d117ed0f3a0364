"""Reward functions for the scorer's tests, importable by the worker processes (they travel by reference)."""

import os
import signal
import time


def slow_unless_ok(completion: str, answer: str) -> float:
    """1.0, except that `slow` sleeps far past any test's time limit first (interruptible by a signal)."""
    if completion == "slow":
        time.sleep(60)
    return 1.0


def stuck_unless_ok(completion: str, answer: str) -> float:
    """1.0, except that `stuck` blocks SIGALRM and sleeps: only killing the process ends it."""
    if completion == "stuck":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(60)
    return 1.0


def not_a_number(completion: str, answer: str) -> object:
    """Returns a string: the scorer must refuse it."""
    return "high"


def recorded_length(completion: str, answer: str) -> float:
    """`len(completion) + len(answer)`, after appending `<wall-clock time> <completion>` to the file named by
    `$REWARD_CALLS` (when the reward was called, seen from outside the worker)."""
    with open(os.environ["REWARD_CALLS"], "a", encoding="utf-8") as calls:
        calls.write(f"{time.time()} {completion}\n")
    return float(len(completion) + len(answer))


def fails_on_bad_slow_on_slow(completion: str, answer: str) -> float:
    """1.0; `bad` raises, `slow` sleeps far past any test's time limit (interruptible by a signal)."""
    if completion == "bad":
        raise ValueError("cannot read this answer")
    return slow_unless_ok(completion, answer)
