"""The GRPO step benchmark runs end to end on its tiny shape on CPU (its GPU figures are reported separately)."""

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
