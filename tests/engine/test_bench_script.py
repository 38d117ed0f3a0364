"""The benchmark script runs end to end on the tiny shape on CPU (its GPU figures are reported separately)."""

from __future__ import annotations

import json


def test_bench_engine_tiny_runs_on_cpu(tmp_path, run_script):
    """Both decode kernels side by side, each against transformers in the same run."""
    table = tmp_path / "rows.json"
    args = ["--tiny", "--device", "cpu", "--skip-hf-batch64", "--decode-attention", "gather"]
    args += ["--decode-attention", "flex", "--flex-min-batch", "1", "--json", str(table)]
    result = run_script("bench_engine.py", args, 120)
    for kernel in ("gather", "flex"):
        assert f"engine ({kernel}, block 32) / transformers (batch 8):" in result.stdout
    rows = json.loads(table.read_text())
    steady = {row["system"]: row for row in rows if row["system"].startswith("engine (")}
    assert sorted(steady) == ["engine (flex, block 32)", "engine (gather, block 32)"]
    for row in steady.values():
        assert row["total_tokens"] == 4 * 2 * 16  # every sample ran to max_tokens (EOS ignored)
        assert row["tokens_per_s"] > 0
