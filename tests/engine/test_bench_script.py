"""The benchmark scripts run end to end on tiny shapes on CPU (their GPU figures are reported separately)."""

from __future__ import annotations

import json

import pytest

from hf_mcore_bridge.models.tiny_models import tiny_config


@pytest.mark.extended
def test_bench_engine_tiny_runs_on_cpu(tmp_path, run_script):
    """Both decode kernels side by side, each against transformers `generate` on the same token count in the same
    run, as the median of the timed runs with their spread."""
    table = tmp_path / "rows.json"
    args = ["--tiny", "--device", "cpu", "--decode-attention", "gather", "--repeats", "2"]
    args += ["--decode-attention", "flex", "--flex-min-batch", "1", "--json", str(table)]
    result = run_script("bench_engine.py", args, 120)
    for kernel in ("gather", "flex"):
        assert f"engine ({kernel}, block 32) / transformers generate (both batch 8, 16 new tokens):" in result.stdout
    records = json.loads(table.read_text())
    rows = [r for r in records if not r["system"].startswith("decode step")]
    timed = {row["system"]: row for row in rows if not row["system"].startswith("engine, first run")}
    assert sorted(timed) == ["engine (flex, block 32)", "engine (gather, block 32)", "transformers generate"]
    for row in timed.values():
        assert row["total_tokens"] == 4 * 2 * 16  # every sample of every system ran to max_tokens (EOS ignored)
        assert row["runs"] == 2 and row["status"] == "ok"
        assert row["seconds_min"] <= row["seconds"] <= row["seconds_max"]
        assert row["tokens_per_s_min"] <= row["tokens_per_s"] <= row["tokens_per_s_max"]
    # each profiled decode step beside its H200 bound (`roofline.decode_step_bound`), for each engine
    steps = [r for r in records if r["system"].startswith("decode step")]
    assert sorted({r["system"] for r in steps}) == ["decode step (flex, block 32)", "decode step (gather, block 32)"]
    assert all(r["decode_ms"] > 0 and r["bound_ms"] > 0 and r["bound"] == "memory" for r in steps)


def test_bench_decode_attention_runs_on_cpu_in_the_interpreter(tmp_path):
    """The decode-kernel table on CPU (Triton's interpreter): every kernel checked against gathered SDPA (the script
    exits non-zero on a mismatch), the engine's own choice of tile and splits among the rows."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "decode.json"
    env = {"PYTHONPATH": str(repo), "PATH": "", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    env |= {key: os.environ[key] for key in ("HOME", "TMPDIR") if key in os.environ}
    args = ["--device", "cpu", "--case", "2x64", "--case", "1x512", "--kv-heads", "2", "--tile-blocks", "0"]
    args += ["--splits", "0", "--splits", "2"]
    result = subprocess.run(
        [sys.executable, "scripts/bench_decode_attention.py", *args, "--json", str(out)],
        cwd=repo,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())
    kernels = {(row["batch"], row["kernel"]) for row in rows}
    assert (2, "gather (SDPA)") in kernels and (1, "flex (eager)") in kernels
    # the interpreter counts as 4 SMs: one sequence's 2 programs are split into 4 ranges of 4 blocks
    assert (1, "triton tile=2(auto) w=4 s=2 splits=4(auto)") in kernels
    assert (1, "triton tile=2(auto) w=4 s=2 splits=2") in kernels
    assert all(row["max_abs_error"] < 2e-2 for row in rows)


def test_bench_fp8_decode_tiny_runs_on_cpu(tmp_path, run_script):
    """The FP8 levers' benchmark end to end on the tiny shape (one variant; the GEMMs on the dequantize path, the
    attention section skipped outside Triton's interpreter): every section recorded, none failed, each time beside
    its bound."""
    result = run_script(
        "bench_fp8_decode.py", ["--tiny", "--device", "cpu", "--variants", "fp8-both", "--out", str(tmp_path)], 300
    )
    assert "blockwise FP8 scaled_mm taken: False (not a CUDA device)" in result.stdout
    records = json.loads((tmp_path / "fp8_decode.json").read_text())
    assert not [name for name, value in records.items() if isinstance(value, str) and value.startswith("error")]
    assert {row["path"] for row in records["gemm"]} == {"bf16 F.linear", "fp8_linear (dequantize)"}
    assert all(row["relative_error"] < 0.05 for row in records["gemm"] if row["relative_error"] is not None)
    steps, _ = records["decode_step fp8-both"]
    assert [s["context"] for s in steps] == [8, 24] and all(s["bound_ms"] > 0 for s in steps)
    run = records["generate fp8-both"]
    assert run["tokens"] == 4 * 4 * 16 and run["bound_s"] > 0 and run["token_mult_prob_error"] >= 1.0


TINY_ARCHITECTURES = {
    "qwen3-30b-a3b": "Qwen3MoeForCausalLM",
    "glm4.5-air": "Glm4MoeForCausalLM",
    "deepseek-v3": "DeepseekV3ForCausalLM",
}
"""The architecture of each MoE benchmark shape, whose tiny test model `--tiny` runs."""


def _run_moe_generation(args: list[str]):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": str(repo), "PATH": "", "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
    env |= {key: os.environ[key] for key in ("HOME", "TMPDIR") if key in os.environ}
    command = [sys.executable, "scripts/bench_moe_generation.py", *args]
    return subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.parametrize(
    "model, kernel, decode",
    [("qwen3-30b-a3b", "triton", "gather"), ("glm4.5-air", "grouped_mm", "gather"), ("deepseek-v3", "exact", "triton")],
)
def test_bench_moe_generation_tiny_runs_on_cpu(tmp_path, model, kernel, decode):
    """The MoE generation benchmark end to end on each shape's tiny model on CPU (the Triton kernels in their
    interpreter): every sample runs to its length, the mean decode step is set beside a bound counted from the
    engine's parameters (their parts add up to the weights it holds) and the experts the batch touched, and three
    decode steps are profiled."""
    out = tmp_path / "moe.json"
    args = [model, "--tiny", "--device", "cpu", "--prompts", "2", "--n", "2", "--prompt-tokens", "8"]
    args += ["--max-new-tokens", "8", "--count-steps", "3", "--moe-kernel", kernel, "--json", str(out)]
    result = _run_moe_generation([*args, "--decode-attention", decode])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "mean decode step" in result.stdout and "x the bound" in result.stdout
    record = json.loads(out.read_text())
    assert (record["moe_kernel"], record["decode_attention"], record["layers"]) == (kernel, decode, 3)
    run, sizes = record["run"], record["sizes"]
    assert run["generated_tokens"] == 4 * 8 and run["decode_steps"] == 7 and run["prefill_steps"] == 1
    assert 0 < run["bound_ms"] <= run["bound_every_expert_ms"]
    assert 1 <= record["experts_touched"] <= sizes["moe_layers"] * sizes["experts_per_layer"]
    config = tiny_config(TINY_ARCHITECTURES[model])
    embedding = config["vocab_size"] * config["hidden_size"] * 4  # untied, float32 on CPU
    routed = sizes["moe_layers"] * sizes["experts_per_layer"] * sizes["expert_bytes"]
    assert sizes["dense_bytes"] + routed + embedding == sizes["weight_bytes"]
    assert [p["context"] for p in record["profile"]] == [12, 16]
    assert all(p["decode_ms"] > 0 and p["bound_ms"] > 0 for p in record["profile"])


def test_bench_moe_generation_refuses_bad_arguments_in_one_line():
    bad = (["qwen3-30b-a3b", "--layers", "49"], ["qwen3-30b-a3b", "--tiles", "8,64,64"], ["qwen3"])
    for args in (*bad, ["qwen3-30b-a3b", "--moe-sort", "fast"]):
        result = _run_moe_generation(args)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and result.stderr.startswith("error:")
