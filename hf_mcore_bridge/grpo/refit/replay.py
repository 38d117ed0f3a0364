"""`RefitReplay`: a refit recorded once as a CUDA graph and replayed after each later training step.

When the trainer and the engine share one GPU and producing the stream takes no collective (world size 1: no TP,
PP, EP or DP peer), a refit is the same sequence of kernels between the same addresses every step: reads of the
trainer's parameters (updated in place by the optimizer), the conversion's temporaries, the engine's parameters
(filled in place by `load_weights`) and the checksums of every streamed tensor (`refit.Checksums`). Most of an
eager refit's time is host work per tensor (walking the table, naming, shape checks: tens of microseconds per
tensor against a copy that takes a few); a replay issues the recorded kernels at once.

How: the refit runs eagerly while anything it depends on is new (the first refit; after the engine reallocated
its weights, as `sleep(level=2)` does; after the trainer's parameters moved). The next refit with the same
sources and engine storage is run through the usual stream and `load_weights` under CUDA stream capture, then
replayed; later ones only replay. The recording's checksum tensors are rewritten by each replay and compared by
the caller as after an eager refit: against the engine's tensors (a replay that copied stale or wrong data into
the engine fails) and, for the trainer tensors the stream read, against those tensors checksummed again outside
the recording (a replay that read stale sources fails, although engine and stream then agree). The checksums are
recorded with the rest: their Triton kernels and torch ops take no host data once the eager refit before the
recording has built and cached their layout tables (`refit.checksums`; a test shows a repeated call builds no
tensor from host data).

Assumes: the trainer's parameters keep their storage between refits unless their addresses change (checked: the
key holds every source's address) and the engine's weights keep theirs unless its `weights_version` changes. If
recording fails, a warning names the error and refits stay eager.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch

from hf_mcore_bridge.grpo.refit.stream import PhaseTimes

Sent = TypeVar("Sent")
"""What a refit returns (the trainer's: `refit.Checksums`, device tensors a replay rewrites)."""


class Replayable(Protocol):
    def replay(self) -> None: ...


Recorder = Callable[[Callable[[], Any]], tuple[Replayable, Any]]
"""Records `fn` (without running it) and returns something that replays it, with `fn`'s outputs."""


def record_cuda_graph(fn: Callable[[], Sent]) -> tuple[Replayable, Sent]:
    """`fn` captured into a CUDA graph (thread-local capture: other threads, e.g. NCCL's watchdog, may go on)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        sent = fn()
    return graph, sent


def engine_weights_version(engine: Any) -> int | None:
    """The embedded engine's `weights_version` (None for an engine whose storage cannot be tracked)."""
    return getattr(getattr(engine, "model", None), "weights_version", None)


@dataclass(frozen=True)
class _Recording:
    key: tuple[Any, ...]
    replayable: Replayable
    sent: Any


class RefitReplay:
    """Runs each refit eagerly, records it, or replays the recording (see the module docstring)."""

    def __init__(self, recorder: Recorder = record_cuda_graph) -> None:
        self.recorder = recorder
        self.disabled = False
        """Set after a recording failed: refits stay eager."""
        self._recording: _Recording | None = None
        self._warm_key: tuple[Any, ...] | None = None

    def run(
        self,
        stream: Callable[[PhaseTimes], Sent],
        sources: Sequence[torch.Tensor] | None,
        engine_version: int | None,
        times: PhaseTimes,
    ) -> tuple[Sent, str]:
        """One refit; returns its checksums and how it ran: `eager`, `recorded` (recorded, then replayed)
        or `replayed`. `stream(times)` performs one eager refit; `sources` are the tensors it reads (None: it
        communicates, so it is never recorded); `engine_version` is the engine's `weights_version`."""
        key = None
        if sources is not None and engine_version is not None and not self.disabled:
            key = (engine_version, *(t.data_ptr() for t in sources))
        if key is None:
            return stream(times), "eager"
        if self._recording is not None and self._recording.key == key:
            self._recording.replayable.replay()
            return self._recording.sent, "replayed"
        if self._warm_key != key:  # something is new: run (and warm up) eagerly first
            self._recording, self._warm_key = None, key
            return stream(times), "eager"
        try:
            replayable, sent = self.recorder(lambda: stream(PhaseTimes(events=False)))
        except Exception as err:  # any failure to record leaves the eager refit, which is exact
            warnings.warn(f"refit recording failed, refits stay eager: {type(err).__name__}: {err}", stacklevel=2)
            self.disabled = True
            return stream(times), "eager"
        replayable.replay()  # recording ran nothing
        self._recording = _Recording(key, replayable, sent)
        return sent, "recorded"
