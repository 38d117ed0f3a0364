"""Metrics logging: JSONL read back, the progress line, TensorBoard scalars read by TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.metrics import MetricsLogger, progress_line, read_metrics

STEPS = [{"reward_mean": 0.25, "kl_ref": 0.0, "clip_fraction": 0.0}, {"reward_mean": 0.5, "kl_ref": 0.01}]


def test_jsonl_round_trip_and_progress_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(tmp_path, print_progress=True)
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()
    assert read_metrics(tmp_path) == [{"step": i, **m} for i, m in enumerate(STEPS, start=1)]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("step 1 | reward 0.250 | kl 0.00e+00 | clip 0.000 |")
    assert "clip nan" in printed[1]  # a metric a step lacks shows as nan rather than failing
    assert progress_line(3, {"refit_s": 0.0123}).count("refit 0.012s") == 1


def test_tensorboard_scalars(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True, print_progress=False)
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward_mean")] == [(1, 0.25), (2, 0.5)]
