"""Reward scoring in worker processes, each sample under a time limit: `RewardScorer`.

Symbolic checkers (sympy under `math-verify`) can take seconds on an answer, or hang in C code on a pathological
one (`9^{9^{9^{9}}}` asks for an integer power no signal interrupts); a step must not wait on it, and the trainer's
rank 0 should not run sympy itself. So:
- Samples are scored by `num_workers` processes (started with `spawn`: rank 0 holds threads and a CUDA context
  that a fork would copy), one sample at a time per worker, each call under a `timeout_s` limit. The limit is a
  real-time interval timer (`setitimer`) in the worker's main thread, where Python delivers signals; math-verify's
  own signal-based limits are not used (they work only in a main thread and would reset the same timer). A sample
  that runs out of time scores 0 and is counted in `ScoreResult.timeouts`.
- A call the timer cannot interrupt (stuck in C code, or one that blocks SIGALRM) is ended from outside: a worker
  still busy `grace_s` after its sample's limit is killed, the sample scores 0 (a timeout) and a new worker takes
  its place; the other workers' samples are unaffected.
- A worker calls the reward once when it starts (untimed, before it takes samples) so that its imports are not
  charged to a sample.
- `num_workers: 0` scores in the calling process under the per-sample timer alone (in its main thread only).

The reward function travels to the workers by reference (module and name), so it must be importable: the
built-ins and `module:function` rewards are. An exception raised by the reward, or a value that is not a finite
number, is an error naming the sample, as `rewards.compute_rewards`.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from numbers import Real
from typing import Any

from hf_mcore_bridge.grpo.rewards import RewardFn

__all__ = ["RewardScorer", "ScoreResult", "score_with_time_limit"]

_TIMED_OUT = None
"""What a sample that ran out of time scores as, before it becomes 0."""


class _SampleTimeout(Exception):
    """Raised inside a reward call by the interval timer."""


def _on_alarm(signum: int, frame: Any) -> None:
    raise _SampleTimeout


def score_with_time_limit(fn: RewardFn, completion: str, answer: str, timeout_s: float) -> float | None:
    """`fn(completion, answer)`, or None when it ran past `timeout_s` seconds (main thread: other threads
    cannot take signals, and there it runs without a limit)."""
    if threading.current_thread() is not threading.main_thread() or timeout_s <= 0:
        return fn(completion, answer)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        signal.setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return fn(completion, answer)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _SampleTimeout:
        return _TIMED_OUT
    finally:
        signal.signal(signal.SIGALRM, previous)


def _checked(value: Any, index: int) -> float:
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise TypeError(f"reward function returned {value!r} for sample {index}; expected a finite float")
    return float(value)


def _worker_main(conn: Connection, fn: RewardFn, timeout_s: float) -> None:
    """A scoring worker: warm up, say so, then score `(index, completion, answer)` messages until `None`. It dies
    with the rank that started it (`world.die_with_parent`), also when that rank is killed."""
    from hf_mcore_bridge.megatron.world import die_with_parent

    die_with_parent()
    with contextlib.suppress(Exception):  # a broken reward is reported by the first real sample, with its index
        fn("0", "0")
    conn.send(("ready", None, None))
    while (message := conn.recv()) is not None:
        index, completion, answer = message
        try:
            value = score_with_time_limit(fn, completion, answer, timeout_s)
            conn.send(("ok", index, None if value is _TIMED_OUT else _checked(value, index)))
        except Exception as err:
            conn.send(("error", index, f"{type(err).__name__}: {err}"))


class _Worker:
    """One scoring process and its pipe; `task` is the sample it is scoring and `since` when it got it."""

    def __init__(self, fn: RewardFn, timeout_s: float) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, fn, timeout_s), daemon=True)
        self.process.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.since = 0.0

    def assign(self, index: int, completion: str, answer: str) -> None:
        self.conn.send((index, completion, answer))
        self.task, self.since = index, time.monotonic()

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


@dataclass(frozen=True)
class ScoreResult:
    """The rewards of one batch, in order, and how many samples ran out of time (scored 0)."""

    rewards: list[float]
    timeouts: int


class RewardScorer:
    """Scores `(completion, answer)` pairs with `fn` in `num_workers` processes, `timeout_s` per sample."""

    def __init__(self, fn: RewardFn, num_workers: int = 4, timeout_s: float = 5.0, grace_s: float = 5.0) -> None:
        if num_workers < 0 or timeout_s < 0 or grace_s < 0:
            raise ValueError("num_workers, timeout_s and grace_s must be >= 0")
        self.fn, self.num_workers, self.timeout_s, self.grace_s = fn, num_workers, timeout_s, grace_s
        self._workers: list[_Worker] = []

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        """Rewards of each pair; a sample out of time scores 0. Raises as `rewards.compute_rewards` does."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        pairs = list(zip(completions, answers, strict=True))
        if self.num_workers == 0:
            raw = [score_with_time_limit(self.fn, c, a, self.timeout_s) for c, a in pairs]
            rewards = [0.0 if value is _TIMED_OUT else _checked(value, i) for i, value in enumerate(raw)]
            return ScoreResult(rewards, sum(value is _TIMED_OUT for value in raw))
        try:
            raw = self._score_in_workers(pairs)
        except BaseException:
            self.close(kill=True)  # workers may still be busy with this batch: their answers would be stale
            raise
        return ScoreResult([0.0 if value is _TIMED_OUT else value for value in raw], raw.count(_TIMED_OUT))

    def _score_in_workers(self, pairs: list[tuple[str, str]]) -> list[float | None]:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.fn, self.timeout_s))
        pending, results, left = deque(range(len(pairs))), [_TIMED_OUT] * len(pairs), len(pairs)
        limit = self.timeout_s + self.grace_s if self.timeout_s > 0 else None
        while left:
            for worker in self._workers:
                if worker.ready and worker.task is None and pending:
                    index = pending.popleft()
                    worker.assign(index, *pairs[index])
            busy = [w for w in self._workers if w.task is not None]
            due = min((w.since + limit for w in busy), default=None) if limit is not None else None
            wait_s = None if due is None else max(0.0, due - time.monotonic())
            for conn in wait([w.conn for w in self._workers], timeout=wait_s):
                worker = next(w for w in self._workers if w.conn is conn)
                left -= self._receive(worker, results)
            for i, worker in enumerate(self._workers):
                if limit is not None and worker.task is not None and time.monotonic() - worker.since > limit:
                    worker.kill()  # past its timer and the grace: stuck where no signal reaches
                    self._workers[i] = _Worker(self.fn, self.timeout_s)
                    left -= 1  # its sample stays a timeout
        return results

    def _receive(self, worker: _Worker, results: list[float | None]) -> int:
        """Handle one message of `worker`; returns how many samples it finished (0 or 1)."""
        try:
            kind, index, value = worker.conn.recv()
        except EOFError:
            raise RuntimeError(
                f"a reward worker died (exit code {worker.process.exitcode}) while scoring sample {worker.task}"
            ) from None
        if kind == "ready":
            worker.ready = True
            return 0
        worker.task = None
        if kind == "error":
            raise (
                TypeError(value)
                if value.startswith("TypeError: reward function")
                else RuntimeError(f"reward function failed on sample {index}: {value}")
            )
        results[index] = value
        return 1

    def close(self, kill: bool = False) -> None:
        """End the workers (`kill`: at once, busy or not)."""
        for worker in self._workers:
            if kill or not worker.process.is_alive():
                worker.kill()
                continue
            with contextlib.suppress(OSError):
                worker.conn.send(None)
            worker.process.join(timeout=self.timeout_s + self.grace_s)
            if worker.process.is_alive():
                worker.kill()
        self._workers = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
