"""`scripts/bench_refit_check.py` runs on CPU (`--tiny`) and reports the check beside a copy of the same bytes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_refit_check_tiny_runs_on_cpu() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "bench_refit_check.py"), "--tiny", "--iters", "2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].startswith("14 tensors,") and "bf16 on cpu" in lines[0]
    assert any(line.startswith("tensor_checksums ") and "2 runs" in line for line in lines)
    assert any(line.startswith("device-to-device copy ") for line in lines)
    assert lines[-1].startswith("check / copy: ")
