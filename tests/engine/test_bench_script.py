"""The benchmark script runs end to end on the tiny shape on CPU (its GPU figures are reported separately)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_engine_tiny_runs_on_cpu(tmp_path):
    """Both decode kernels side by side, each against transformers in the same run."""
    table = tmp_path / "rows.json"
    command = [sys.executable, "scripts/bench_engine.py", "--tiny", "--device", "cpu", "--skip-hf-batch64"]
    command += ["--decode-attention", "gather", "--decode-attention", "flex", "--flex-min-batch", "1"]
    command += ["--json", str(table)]
    result = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(ROOT), "PATH": "", "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-2000:]
    for kernel in ("gather", "flex"):
        assert f"engine ({kernel}, block 16) / transformers (batch 8):" in result.stdout
    rows = json.loads(table.read_text())
    steady = {row["system"]: row for row in rows if row["system"].startswith("engine (")}
    assert sorted(steady) == ["engine (flex, block 16)", "engine (gather, block 16)"]
    for row in steady.values():
        assert row["total_tokens"] == 4 * 2 * 16  # every sample ran to max_tokens (EOS ignored)
        assert row["tokens_per_s"] > 0
