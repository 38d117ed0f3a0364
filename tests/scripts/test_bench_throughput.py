"""The throughput summary reads each benchmark's JSON into the goal table (figures as the scripts write them)."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_throughput  # noqa: E402


def _training(path: str, tokens_per_gpu: float, status: str = "ok", layout: str = "L") -> dict:
    return {
        "shape": "s",
        "seq_len": 4096,
        "path": path,
        "layout": layout,
        "status": status,
        "tokens_per_s_per_gpu": tokens_per_gpu,
        "mfu": 0.3,
    }


def test_training_rows_report_each_path_and_the_megatron_over_dtensor_ratio() -> None:
    record = {"results": [_training("megatron", 6000.0), _training("dtensor", 5000.0), _training("hf", 0.0, "OOM")]}
    rows = bench_throughput.training_rows(record)
    assert rows[0][1] == "megatron 6,000 (30.0%), dtensor 5,000 (30.0%), hf OOM"
    assert rows[1][1:] == ("1.20x", ">= 1.2x")
    assert bench_throughput.training_rows(None)[0][1].startswith("failed")


def test_a_path_at_two_layouts_is_listed_twice_and_compared_at_its_fastest() -> None:
    record = [
        _training("megatron", 4000.0, layout="TP1 DP2 dist-opt"),
        _training("megatron", 7000.0, layout="TP2 SP"),
        _training("dtensor", 5000.0),
    ]
    rows = bench_throughput.training_rows(record)
    assert (
        rows[0][1]
        == "megatron [TP1 DP2 dist-opt] 4,000 (30.0%), megatron [TP2 SP] 7,000 (30.0%), dtensor 5,000 (30.0%)"
    )
    assert rows[1][1] == "1.40x"


def _engine(system: str, tokens_per_s: float, status: str = "ok") -> dict:
    return {
        "system": system,
        "batch": 512,
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_min": tokens_per_s * 0.9,
        "tokens_per_s_max": tokens_per_s * 1.1,
        "status": status,
    }


def test_engine_and_grpo_rows_give_the_goal_ratios() -> None:
    engine = [  # the rows bench_engine.py writes: two kernels, then transformers' two ways on the same workload
        _engine("engine, first run (flex, block 16)", 100.0),
        _engine("engine (flex, block 16)", 400.0),
        _engine("engine, first run (gather, block 16)", 90.0),
        _engine("engine (gather, block 16)", 200.0),
        _engine("transformers generate", 20.0),
        _engine("transformers generate_batch (continuous batching)", 0.0, "error: AttributeError: no generate_batch"),
    ]
    rows = bench_throughput.engine_rows(engine)
    assert [r[1] for r in rows] == [
        "400 (360-440)",
        "20.0x",
        "error: AttributeError: no generate_batch",
        "200 (180-220)",
        "10.0x",
        "error: AttributeError: no generate_batch",
        "20 (18-22)",
    ]
    assert rows[0][0].endswith("(flex, block 16)") and rows[1][2] == ">= 20x"
    assert rows[1][0] == "  engine / generate (batch 512, same tokens)"
    engine[-1] = _engine("transformers generate_batch (continuous batching)", 50.0)
    step = {"system": "decode step (flex, block 16)", "rows": 512, "context": 640, "bound": "memory"}
    engine.append(step | {"decode_ms": 5.0, "bound_ms": 1.0})
    rows = bench_throughput.engine_rows(engine)
    assert rows[2][1:] == ("8.0x", "")
    assert rows[-1] == (
        "decode step (flex, block 16), 512 x 640 tokens",
        "5.00 ms; H200 bound 1.00 ms (memory): 20% of the limit",
        "",
    )
    phases = {"generation_s": 1.0, "logprobs_s": 0.5, "train_s": 2.0, "refit_s": 0.006, "step_s": 3.6}
    rows = bench_throughput.grpo_rows({"phases": phases, "d2d_copy_s": 0.002})
    assert rows[-1][1:] == ("3.0x", "<= 3x")
    assert [r[1] for r in rows[:5]] == ["1.000 s", "0.500 s", "2.000 s", "0.006 s", "3.600 s"]


def test_a_stopped_training_run_reports_what_it_measured() -> None:
    record = {"complete": False, "results": [_training("megatron", 6000.0)]}
    rows = bench_throughput.training_rows(record)
    assert rows[0][1].startswith("stopped early")
    assert rows[1][1] == "megatron 6,000 (30.0%)"


def test_a_part_past_its_time_limit_is_stopped_with_its_children(tmp_path: Path, monkeypatch) -> None:
    """The script and the process it started (as the training ranks are) are both gone when `_run` returns."""
    import os
    import time

    child_pid = tmp_path / "child.pid"
    (tmp_path / "slow.py").write_text(
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(child_pid)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    monkeypatch.setattr(bench_throughput, "HERE", tmp_path)
    start = time.monotonic()
    ok = bench_throughput._run("slow.py", [], tmp_path / "slow.log", time_limit=3.0)
    assert not ok and time.monotonic() - start < 30
    assert "started" in (tmp_path / "slow.log").read_text()
    pid = int(child_pid.read_text())
    for _ in range(50):  # the child is killed with the group; give the kernel a moment to reap it
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (killed, not yet reaped by init) counts as gone
            assert stat.read().split()[2] == "Z"
