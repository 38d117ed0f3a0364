"""Writing planned byte ranges of output files on worker threads that stop cleanly.

A conversion knows every output byte range before it writes (sizes come from the plan), so its writes can be
split into independent queues, one per output file, each run by its own thread. The copies happen in the kernel
(`byte_copy`), which releases the interpreter lock, so two queues use two cores.

The calling thread only waits: it reports progress, and it is where Python delivers SIGINT and SIGTERM. When it is
interrupted, or a worker fails, it sets a stop event that every worker checks between system calls (each moves at
most `byte_copy.STEP` bytes), waits for the workers to end, and raises the interruption or the first failure,
with nothing left running to write into the output after the caller has removed it. A single queue runs in the
calling thread itself.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from hf_mcore_bridge.checkpoint.byte_copy import InputFiles, Piece, Stopped, write_pieces

_POLL_S = 0.2


@dataclass(frozen=True)
class Job:
    """Pieces to write one after another into `path` from `offset` on."""

    path: Path
    offset: int
    pieces: tuple[Piece, ...]


class _Worker:
    """Runs one queue of jobs; owns its descriptors of outputs and inputs."""

    def __init__(self, jobs: Sequence[Job], stop: threading.Event, done: Callable[[], None]):
        self.jobs, self.stop, self.done = jobs, stop, done
        self.error: BaseException | None = None

    def run(self) -> None:
        inputs = InputFiles()
        outputs: dict[Path, int] = {}
        try:
            for job in self.jobs:
                fd = outputs.get(job.path)
                if fd is None:
                    fd = outputs[job.path] = os.open(job.path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
                write_pieces(fd, job.path, job.offset, job.pieces, inputs, self.stop)
                self.done()
        except Stopped:
            pass
        except BaseException as err:  # handed to the calling thread, which raises it
            self.error = err
            self.stop.set()
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
        worker = _Worker(queues[0] if queues else [], stop, on_done)
        worker.run()
        if worker.error is not None:
            raise worker.error
        return
    finished: queue.SimpleQueue[None] = queue.SimpleQueue()
    workers = [_Worker(jobs, stop, lambda: finished.put(None)) for jobs in queues]
    threads = [threading.Thread(target=w.run, name=f"bridge-writer-{i}", daemon=True) for i, w in enumerate(workers)]
    try:
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads) and not stop.is_set():
            _report(finished, on_done, block=True)
    except BaseException:
        stop.set()  # interrupted (SIGINT, SIGTERM) or the progress report failed: stop the workers first
        raise
    finally:
        for thread in threads:
            thread.join()
    _report(finished, on_done, block=False)
    errors = [w.error for w in workers if w.error is not None]
    if errors:
        raise errors[0]


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
