"""Writing planned byte ranges of output files on worker threads that stop cleanly.

A conversion knows every output byte range before it writes (sizes come from the plan), so its writes can be
split into independent queues, one per output file, each run by a worker of a `ThreadPoolExecutor`. The copies
happen in the kernel (`byte_copy`), which releases the interpreter lock, so two queues use two cores.

The calling thread only waits: it reports progress, and it is where Python delivers SIGINT and SIGTERM. When it is
interrupted, or a worker fails, it sets a stop event that every worker checks between system calls (each moves at
most `byte_copy.STEP` bytes), waits for the workers to end (leaving the executor joins them), and raises the
interruption or the first failure, with nothing left running to write into the output after the caller has
removed it. The stop event is this module's own because an executor cannot stop a task that has started
(`shutdown(cancel_futures=True)` drops only those still queued). A single queue runs in the calling thread itself.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from hf_mcore_bridge.checkpoint.byte_copy import InputFiles, Piece, Stopped, write_pieces

_POLL_S = 0.2
THREAD_PREFIX = "bridge-writer"
"""Worker threads are named `bridge-writer_0`, `bridge-writer_1`, ..."""


@dataclass(frozen=True)
class Job:
    """Pieces to write one after another into `path` from `offset` on."""

    path: Path
    offset: int
    pieces: tuple[Piece, ...]


def _run_queue(jobs: Sequence[Job], stop: threading.Event, done: Callable[[], None]) -> None:
    """Run one queue of jobs with its own descriptors of outputs and inputs; returns early when `stop` is set."""
    inputs = InputFiles()
    outputs: dict[Path, int] = {}
    try:
        for job in jobs:
            fd = outputs.get(job.path)
            if fd is None:
                fd = outputs[job.path] = os.open(job.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
            write_pieces(fd, job.path, job.offset, job.pieces, inputs, stop)
            done()
    except Stopped:
        pass
    finally:
        inputs.close()
        for fd in outputs.values():
            os.close(fd)


def run_jobs(queues: Sequence[Sequence[Job]], on_done: Callable[[], None] = lambda: None) -> None:
    """Run each queue of jobs in order, the queues in parallel; `on_done` is called (in this thread) once per job.

    Raises the first worker's failure, or the interruption of this thread, after every worker has stopped.
    """
    queues = [q for q in queues if q]
    stop = threading.Event()
    if len(queues) <= 1:
        _run_queue(queues[0] if queues else [], stop, on_done)
        return
    finished: queue.SimpleQueue[None] = queue.SimpleQueue()
    failures: list[BaseException] = []

    def failed(future: Future[None]) -> None:  # in the worker that ends: stop the others at once
        error = future.exception()
        if error is not None:
            failures.append(error)
            stop.set()

    with ThreadPoolExecutor(max_workers=len(queues), thread_name_prefix=THREAD_PREFIX) as pool:
        futures = [pool.submit(_run_queue, jobs, stop, lambda: finished.put(None)) for jobs in queues]
        for future in futures:
            future.add_done_callback(failed)
        try:
            while not all(f.done() for f in futures) and not stop.is_set():
                _report(finished, on_done, block=True)
        except BaseException:
            stop.set()  # interrupted (SIGINT, SIGTERM) or the progress report failed: stop the workers first
            raise
    _report(finished, on_done, block=False)
    if failures:
        raise failures[0]


def _report(finished: queue.SimpleQueue[None], on_done: Callable[[], None], *, block: bool) -> None:
    try:
        finished.get(timeout=_POLL_S) if block else finished.get_nowait()
    except queue.Empty:
        return
    on_done()
    while True:
        try:
            finished.get_nowait()
        except queue.Empty:
            return
        on_done()
