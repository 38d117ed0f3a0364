"""The benchmark script runs end to end on the tiny shape on CPU (its GPU figures are reported separately)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_tiny_runs_on_cpu():
    result = subprocess.run(
        [sys.executable, "scripts/bench_engine.py", "--tiny", "--device", "cpu", "--skip-hf-batch64"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "engine / transformers (batch 8):" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines()]
    engine_rows = [row for row in rows if row[:1] == ["engine"] and row[1].isdigit()]
    assert len(engine_rows) == 1
    assert int(engine_rows[0][3]) == 4 * 2 * 16  # every sample ran to max_tokens (EOS ignored)
