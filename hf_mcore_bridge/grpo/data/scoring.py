"""Reward scoring in worker processes, each sample under a time limit: `RewardScorer`.

Symbolic checkers (sympy under `math-verify`) can take seconds on an answer, or hang in C code on a pathological
one (`9^{9^{9^{9}}}` asks for an integer power no signal interrupts); a step must not wait on it, and the trainer's
rank 0 should not run sympy itself. So:
- Samples are scored by `num_workers` processes (started with `spawn`: rank 0 holds threads and a CUDA context
  that a fork would copy), one sample at a time per worker, each call under a `timeout_s` limit. The limit is a
  real-time interval timer (`setitimer`) in the worker's main thread, where Python delivers signals; math-verify's
  own signal-based limits are not used (they work only in a main thread and would reset the same timer). A sample
  that runs out of time scores 0 and is counted in `ScoreResult.timeouts`. The limit is wall-clock time: on a host
  whose cores are all busy a sample near its limit can pass it.
- A call the timer cannot interrupt (stuck in C code, or one that blocks SIGALRM) is ended from outside: a worker
  still busy `grace_s` after its sample's limit is killed, the sample scores 0 (a timeout) and a new worker takes
  its place; the other workers' samples are unaffected.
- A worker calls the reward once when it starts (untimed, before it takes samples) so that its imports are not
  charged to a sample.
- `num_workers: 0` scores in the calling process under the per-sample timer alone (in its main thread only).

Scoring overlaps whatever produces the samples (`RewardScorer.start`): a `ScoringBatch` takes each sample the
moment it exists (`submit`, which returns at once) and `result()` waits only for the scores still outstanding.
While the caller is busy elsewhere (generating), a thread of this process feeds the workers (it only moves
messages; the scoring runs in the workers); `result()` takes over from it. Workers are only ever started by the
caller's thread, in `start` and `result`: Linux ties `PR_SET_PDEATHSIG` (workers die with their rank) to the
thread that started a process, and the feeding thread ends with its batch. A worker killed while that thread
feeds is therefore replaced when `result()` takes over; until then the pool is one short. `score` is `start`,
every sample submitted in order, then `result`: one path for both.

The reward function travels to the workers by reference (module and name), so it must be importable: the
built-ins and `module:function` rewards are. An exception raised by the reward, or a value that is not a finite
number, is an error naming the sample, as `rewards.compute_rewards`: raised by `result()`, or by the next
`submit` once the pool has seen it (the batch stops feeding the workers at the first error).

Why a pool of its own rather than the standard library's: `multiprocessing.Pool` cannot end one stuck task (its
`get(timeout)` leaves the worker busy for good), and `concurrent.futures.ProcessPoolExecutor` treats a killed
worker as a broken pool (`BrokenProcessPool`, every pending sample lost), and `Pool` starts the workers that
replace others from a thread of its own, whose end `PR_SET_PDEATHSIG` would take for the rank's. So the pool here
is spawn processes and pipes of `multiprocessing` with the kill-and-replace above, and no more.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from numbers import Real
from typing import Any

from hf_mcore_bridge.grpo.data.rewards import RewardFn

__all__ = ["RewardScorer", "ScoreResult", "ScoringBatch", "score_with_time_limit"]

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
    with the rank that started it (`process_death.die_with_parent`), also when that rank is killed."""
    from hf_mcore_bridge.megatron.process_death import die_with_parent

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


class ScoringBatch:
    """`count` samples scored as they arrive (`RewardScorer.start`): `submit(index, completion, answer)` once for
    each index in `range(count)`, in any order, then `result()`. Used as a context manager: left without
    `result()` (an error while the samples were being made), it ends the batch and kills the workers that may
    still be busy with it (their answers would be stale)."""

    def __init__(self, scorer: RewardScorer, count: int) -> None:
        if count < 0:
            raise ValueError(f"a batch of {count} samples")
        self.count = count
        self._scorer = scorer
        self._given = [False] * count
        self._results: list[float | None] = [_TIMED_OUT] * count
        self._done = False

    def submit(self, index: int, completion: str, answer: str) -> None:
        """Hand sample `index` over for scoring; returns at once (with workers). Raises a reward error the pool
        has already seen (see the module docstring)."""
        if self._done:
            raise RuntimeError("this scoring batch has ended")
        if not 0 <= index < self.count:
            raise IndexError(f"sample {index} is outside the batch's {self.count}")
        if self._given[index]:
            raise ValueError(f"sample {index} was submitted twice")
        self._given[index] = True
        self._take(index, completion, answer)

    def result(self) -> ScoreResult:
        """Wait for the scores still outstanding; the rewards in index order (a sample out of time scores 0)."""
        if self._done:
            raise RuntimeError("this scoring batch has ended")
        if missing := self._given.count(False):
            self._end(cancelled=True)
            raise ValueError(f"{missing} of the batch's {self.count} samples were never submitted")
        try:
            self._finish()
        except BaseException:
            self._end(cancelled=True)
            raise
        self._end(cancelled=False)
        timeouts = self._results.count(_TIMED_OUT)
        return ScoreResult([0.0 if value is _TIMED_OUT else value for value in self._results], timeouts)

    def _take(self, index: int, completion: str, answer: str) -> None:
        raise NotImplementedError

    def _finish(self) -> None:
        """Block until every submitted sample is scored (or out of time)."""

    def _end(self, cancelled: bool) -> None:
        self._done = True
        self._scorer._batch = None

    def __enter__(self) -> ScoringBatch:
        return self

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self._end(cancelled=True)


class _InProcessBatch(ScoringBatch):
    """`num_workers: 0`: each sample scored inside `submit`, under the per-sample timer (main thread only)."""

    def _take(self, index: int, completion: str, answer: str) -> None:
        value = score_with_time_limit(self._scorer.fn, completion, answer, self._scorer.timeout_s)
        self._results[index] = _TIMED_OUT if value is _TIMED_OUT else _checked(value, index)


class _PooledBatch(ScoringBatch):
    """Samples scored by the scorer's workers: fed by a thread of this process while the caller is busy, by the
    caller's own thread from `result()` on (see the module docstring)."""

    def __init__(self, scorer: RewardScorer, count: int) -> None:
        super().__init__(scorer, count)
        scorer._top_up()  # in the caller's thread: see the module docstring
        self._limit = scorer.timeout_s + scorer.grace_s if scorer.timeout_s > 0 else None
        self._inbox: deque[tuple[int, str, str]] = deque()  # appended by `submit`, taken by whoever feeds
        self._pending: deque[int] = deque()
        self._pairs: dict[int, tuple[str, str]] = {}
        self._outstanding = 0  # taken from the inbox, not yet scored
        self._wake_r, self._wake_w = os.pipe()  # a byte here wakes the feeder from its wait on the workers
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._handing_over = False
        self._error: BaseException | None = None
        self._feeder = threading.Thread(target=self._feed, name="reward-feeder", daemon=True)
        self._feeder.start()

    def _take(self, index: int, completion: str, answer: str) -> None:
        if self._error is not None:
            raise self._error
        self._inbox.append((index, completion, answer))
        self._wake()

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full pipe already wakes the feeder
            os.write(self._wake_w, b"\0")

    def _feed(self) -> None:
        try:
            while not self._handing_over:
                self._turn(may_start=False)
        except BaseException as err:  # raised in the caller's thread, by `submit` or `result`
            self._error = err

    def _hand_over(self) -> None:
        self._handing_over = True
        self._wake()
        self._feeder.join()

    def _finish(self) -> None:
        self._hand_over()
        if self._error is not None:
            raise self._error
        self._scorer._top_up()  # workers the feeder had to kill are replaced here
        while self._inbox or self._outstanding:
            self._turn(may_start=True)

    def _turn(self, may_start: bool) -> None:
        """Take new samples, give idle workers work, wait for an answer (or the next deadline), end workers past
        their sample's deadline (replaced only where `may_start`: in the caller's thread)."""
        while self._inbox:
            index, completion, answer = self._inbox.popleft()
            self._pending.append(index)
            self._pairs[index] = (completion, answer)
            self._outstanding += 1
        scorer = self._scorer
        for worker in scorer._workers:
            if worker.ready and worker.task is None and self._pending:
                index = self._pending.popleft()
                worker.assign(index, *self._pairs.pop(index))
        busy = [w for w in scorer._workers if w.task is not None]
        due = min((w.since + self._limit for w in busy), default=None) if self._limit is not None else None
        wait_s = None if due is None else max(0.0, due - time.monotonic())
        for ready in wait([self._wake_r, *(w.conn for w in scorer._workers)], timeout=wait_s):
            if isinstance(ready, int):
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
                continue
            worker = next(w for w in scorer._workers if w.conn is ready)
            self._outstanding -= scorer._receive(worker, self._results)
        kept = []
        for worker in scorer._workers:
            if self._limit is not None and worker.task is not None and time.monotonic() - worker.since > self._limit:
                worker.kill()  # past its timer and the grace: stuck where no signal reaches
                self._outstanding -= 1  # its sample stays a timeout
                if may_start:
                    kept.append(_Worker(scorer.fn, scorer.timeout_s))
            else:
                kept.append(worker)
        scorer._workers = kept

    def _end(self, cancelled: bool) -> None:
        if self._feeder.is_alive():
            self._hand_over()
        os.close(self._wake_r)
        os.close(self._wake_w)
        super()._end(cancelled)
        if cancelled:
            self._scorer.close(kill=True)


class RewardScorer:
    """Scores `(completion, answer)` pairs with `fn` in `num_workers` processes, `timeout_s` per sample."""

    def __init__(self, fn: RewardFn, num_workers: int = 4, timeout_s: float = 5.0, grace_s: float = 5.0) -> None:
        if num_workers < 0 or timeout_s < 0 or grace_s < 0:
            raise ValueError("num_workers, timeout_s and grace_s must be >= 0")
        self.fn, self.num_workers, self.timeout_s, self.grace_s = fn, num_workers, timeout_s, grace_s
        self._workers: list[_Worker] = []
        self._batch: ScoringBatch | None = None

    def start(self, count: int) -> ScoringBatch:
        """A batch of `count` samples to `submit` as they are made, then `result()` (one batch at a time)."""
        if self._batch is not None:
            raise RuntimeError("a scoring batch is open: take its result() first")
        batch = _InProcessBatch(self, count) if self.num_workers == 0 else _PooledBatch(self, count)
        self._batch = batch
        return batch

    def score(self, completions: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        """Rewards of each pair; a sample out of time scores 0. Raises as `rewards.compute_rewards` does."""
        if len(completions) != len(answers):
            raise ValueError(f"{len(completions)} completions but {len(answers)} answers")
        with self.start(len(completions)) as batch:
            for index, (completion, answer) in enumerate(zip(completions, answers, strict=True)):
                batch.submit(index, completion, answer)
            return batch.result()

    def _top_up(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.fn, self.timeout_s))

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
        """End the workers (`kill`: at once, busy or not); an open batch ends first, unscored."""
        if self._batch is not None:
            self._batch.__exit__(None, None, None)  # ends it, killing the workers it may have left busy
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
