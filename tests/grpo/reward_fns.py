"""Reward functions for the scorer's tests, importable by the worker processes (they travel by reference)."""

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
