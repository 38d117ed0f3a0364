"""Metrics logging: JSONL read back, the progress line, TensorBoard scalars read by TensorBoard's own reader."""

from __future__ import annotations

from pathlib import Path

import pytest

from hf_mcore_bridge.grpo.run.metrics import MetricsLogger, progress_line, read_metrics

STEPS = [{"reward_mean": 0.25, "kl_ref": 0.0, "clip_fraction": 0.0}, {"reward_mean": 0.5, "kl_ref": 0.01}]


def test_jsonl_round_trip_and_progress_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logger = MetricsLogger(tmp_path, print_progress=True)
    for step, metrics in enumerate(STEPS, start=1):
        logger.log(step, metrics)
    logger.close()
    assert read_metrics(tmp_path) == [{"step": i, **m} for i, m in enumerate(STEPS, start=1)]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("step 1 | reward 0.250 | kl 0.00e+00 | clip 0.000")
    assert printed[1] == "step 2 | reward 0.500 | kl 1.00e-02"  # a metric a step lacks is left out, not failing
    assert progress_line(3, {"refit_s": 0.0123}).count("refit 0.012s") == 1


def test_a_metric_that_is_off_is_left_out_and_nan_means_a_value_went_wrong() -> None:
    """`loss_fn.kl_coef: 0` computes no `kl_ref`: the line has no KL rather than `kl nan`; a metric that is there
    but NaN still shows as `nan`."""
    step = {"reward_mean": 0.5, "clip_fraction": 0.0, "tokens_per_s": 812.0, "refit_s": 0.02, "step_s": 1.1}
    assert progress_line(4, step) == "step 4 | reward 0.500 | clip 0.000 | 812 tok/s | refit 0.020s | step 1.10s"
    assert "nan" not in progress_line(4, step)
    assert progress_line(4, step | {"kl_ref": float("nan")}).startswith("step 4 | reward 0.500 | kl nan | clip")


def test_the_model_card_shows_a_kl_that_was_off_as_off() -> None:
    from hf_mcore_bridge.grpo.run.export import model_card

    card = model_card(
        None, None, [{"step": 1, "reward_mean": 0.25}, {"step": 2, "reward_mean": 0.5, "kl_ref": 0.01}], 2
    )
    assert "| 1 | 0.2500 | off |" in card and "| 2 | 0.5000 | 0.01 |" in card and "nan" not in card


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
