"""The GRPO benchmarks run end to end on tiny shapes on CPU (their GPU and CPU figures are reported separately)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def test_bench_grpo_tiny_reports_every_phase(tmp_path: Path, run_script) -> None:
    out = tmp_path / "result.json"
    result = run_script("bench_grpo.py", ["--tiny", "--work", str(tmp_path / "work"), "--json", str(out)], 300)
    record = json.loads(out.read_text())
    phases = record["phases"]
    for key in ("generation_s", "logprobs_s", "train_s", "refit_s", "step_s"):
        assert math.isfinite(phases[key]) and phases[key] > 0, key
    assert phases["step_s"] >= phases["generation_s"] + phases["train_s"]
    assert len(record["metrics"]) == 2
    assert "whole step" in result.stdout
    assert record["engine_replicas"] == 1 and "refit path: " in result.stdout


def test_bench_scoring_tiny_compares_both_modes(tmp_path: Path, run_script) -> None:
    out = tmp_path / "result.json"
    args = ["--rounds", "1", "--trainer-runs", "0", "--no-control", "--prompts", "2", "--generations", "2"]
    args += ["--max-new-tokens", "8", "--hidden", "64", "--layers", "1", "--work", str(tmp_path / "work")]
    result = run_script("bench_scoring.py", [*args, "--json", str(out)], 300)
    record = json.loads(out.read_text())
    assert record["rewards_equal"] is True
    for mode in ("after", "overlapped"):
        phase = record["rollout_phase"][mode]
        assert phase["generation_s"]["median"] >= phase["reward_wait_s"]["median"] >= 0
    assert "rewards equal in both modes, round by round: yes" in result.stdout


@pytest.mark.extended
def test_bench_recipe_step_smoke_fits_a_per_layer_cost(tmp_path: Path, run_script) -> None:
    out = tmp_path / "result.json"
    args = ["qwen3-8b", "--smoke", "--layers", "1", "2", "--steps", "2", "--work", str(tmp_path / "work")]
    result = run_script("bench_recipe_step.py", [*args, "--json", str(out)], 400)
    record = json.loads(out.read_text())
    assert sorted(record["depths"]) == ["1", "2"] and record["full_depth"] == 36
    assert record["share"]["replicas"] == 4  # the recipe's 8 GPUs at TP2
    for key in ("generation_s", "train_s", "step_s"):
        assert math.isfinite(record["fit"][key]["extrapolated_s"]), key
    assert "36 layers (extrapolated)" in result.stdout
