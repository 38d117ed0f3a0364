"""`RefitReplay`'s decisions (eager while anything is new, then record, then replay; back to eager when the engine's
storage or the trainer's parameters move; eager for good if recording fails), with a stand-in recorder that
replays by re-running the refit into the recorded outputs: a CPU cannot capture CUDA graphs. The replay of a real
CUDA graph runs in the GPU benchmarks (`bench_grpo.py`), whose refits are checksum-checked every step."""

from __future__ import annotations

import pytest
import torch

from hf_mcore_bridge.grpo.refit.replay import RefitReplay
from hf_mcore_bridge.grpo.refit.stream import PhaseTimes, tensor_checksums


class EagerRecording:
    """Replays by running the refit again and writing its checksums into the recorded ones."""

    def __init__(self, fn, sent) -> None:
        self.fn, self.sent, self.replays = fn, sent, 0

    def replay(self) -> None:
        self.replays += 1
        for name, value in self.fn().items():
            self.sent[name].copy_(value)


def eager_recorder(fn):
    sent = fn()
    recording = EagerRecording(fn, sent)
    eager_recorder.last = recording
    return recording, sent


class Refit:
    """A trainer parameter streamed into an 'engine' tensor, its checksum sent along."""

    def __init__(self) -> None:
        self.source = torch.arange(6, dtype=torch.float32)
        self.engine = torch.zeros(6)
        self.runs = 0

    def __call__(self, times: PhaseTimes) -> dict[str, torch.Tensor]:
        self.runs += 1
        with times.phase("load"):
            self.engine.copy_(self.source * 2)
        return {"w": tensor_checksums([self.source * 2])}


def test_eager_then_recorded_then_replayed_and_again_after_storage_changes():
    refit, replay = Refit(), RefitReplay(recorder=eager_recorder)
    modes = []
    for step in range(4):
        refit.source.add_(1.0)  # a training step updates the parameter in place
        sent, mode = replay.run(refit, [refit.source], engine_version=0, times=PhaseTimes())
        modes.append(mode)
        assert torch.equal(refit.engine, refit.source * 2), step
        assert torch.equal(sent["w"], tensor_checksums([refit.engine]))
    assert modes == ["eager", "recorded", "replayed", "replayed"]
    assert eager_recorder.last.replays == 3  # the recording, then two steps
    _, mode = replay.run(refit, [refit.source], engine_version=1, times=PhaseTimes())  # the engine reallocated
    assert mode == "eager"
    refit.source = refit.source.clone()  # the trainer's parameter moved
    assert replay.run(refit, [refit.source], engine_version=1, times=PhaseTimes())[1] == "eager"
    assert replay.run(refit, [refit.source], engine_version=1, times=PhaseTimes())[1] == "recorded"


def test_a_refit_that_communicates_is_never_recorded():
    refit, replay = Refit(), RefitReplay(recorder=eager_recorder)
    assert [replay.run(refit, None, 0, PhaseTimes())[1] for _ in range(3)] == ["eager"] * 3
    assert [replay.run(refit, [refit.source], None, PhaseTimes())[1] for _ in range(3)] == ["eager"] * 3


def test_a_failed_recording_warns_and_leaves_refits_eager():
    def broken(fn):
        raise RuntimeError("capture not permitted")

    refit, replay = Refit(), RefitReplay(recorder=broken)
    assert replay.run(refit, [refit.source], 0, PhaseTimes())[1] == "eager"
    with pytest.warns(UserWarning, match="refit recording failed, refits stay eager: RuntimeError: capture not"):
        sent, mode = replay.run(refit, [refit.source], 0, PhaseTimes())
    assert mode == "eager" and replay.disabled and torch.equal(refit.engine, refit.source * 2)
    assert torch.equal(sent["w"], tensor_checksums([refit.engine]))
    assert replay.run(refit, [refit.source], 0, PhaseTimes())[1] == "eager"
