"""Every throughput figure of the project in one command: training, generation, refit and a whole GRPO step.

Runs the three benchmark scripts one after another (each in its own process, so each starts with a clean GPU) and
prints one table of the figures the goals are set against:

a) `bench_training.py`: training tokens/s per GPU and MFU of the Megatron path, the DTensor (FSDP2) path and plain
   HF, Llama-3.2-1B and Llama-3.1-8B shapes, packed rows of 4096 and 16384 tokens (goal: Megatron >= 1.2x
   DTensor; MFU >= 45% on the 8B shape);
b) `bench_engine.py`: the embedded engine against transformers `generate`, 1B shape, 64 prompts x 8 samples,
   512 new tokens (goal >= 20x);
c) and d) `bench_grpo.py`: a GRPO step on the 1B shape broken into generation, log-probs, training and refit, and
   the refit against a device-to-device copy of the same bytes (goal <= 3x).

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/bench_throughput.py --nproc 2 --out bench/ --training-time-limit 400  # 2 x H200
    python scripts/bench_throughput.py --tiny --out /tmp/bench               # tiny shapes on CPU (smoke test)

Time on 2 x H200: 569 s in all, of which the training part took 388 s (both shapes, both row lengths, all three
paths, 32768 tokens per GPU per optimizer step, the 8B Megatron 16384-token rows again at TP2) and the engine and
GRPO parts about 165 s (figures:
`docs/PERFORMANCE.md`). `--training-time-limit` stops the training part when its time is up (the training rows
measured by then are reported and the table says it stopped early), so that the other parts still run within a
bounded call; `--training-args` passes options to `bench_training.py` (e.g. `--training-args "--paths
megatron,dtensor --iters 2"`), or run `--parts training` on its own.

Each part also writes its own JSON under `--out`; a part that fails is reported as such and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _run(name: str, args: list[str], log: Path, time_limit: float = 0.0) -> bool:
    """Run one benchmark script, its output to the terminal and to `log`; whether it succeeded. With a
    `time_limit` (seconds, 0: none) the script and every process it started are stopped when it runs out."""
    print(f"\n=== {name}: {' '.join(args)}", flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with log.open("w") as handle:
        command = [sys.executable, str(HERE / name), *args]
        process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
        )
        assert process.stdout is not None
        stream = process.stdout

        def pump() -> None:
            for line in stream:
                handle.write(line)
                if "warn" not in line.lower():
                    print(line, end="", flush=True)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            code = process.wait(timeout=time_limit or None)
        except subprocess.TimeoutExpired:
            print(f"=== {name}: stopped at its {time_limit:.0f} s limit", flush=True)
            os.killpg(process.pid, signal.SIGKILL)  # the ranks it spawned are in its session
            code = process.wait()
        reader.join(timeout=10)
        return code == 0


def _load(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


def training_rows(record: Any) -> list[tuple[str, str, str]]:
    """(figure, value, goal) rows from `bench_training.py`'s JSON: per shape and length, each path's tokens/s per
    GPU and MFU (with its layout where a path ran at several), and Megatron over DTensor, each at its fastest."""
    if not record:
        return [("training", "failed (see training.log)", "")]
    rows = []
    if isinstance(record, dict) and not record.get("complete", True):
        rows.append(("training", "stopped early (time limit or failure): the rows below are what it measured", ""))
    results = record["results"] if isinstance(record, dict) else record
    for shape, seq_len in sorted({(r["shape"], r["seq_len"]) for r in results}):
        cells, fastest = [], {}
        for path in ("megatron", "dtensor", "hf"):
            runs = [r for r in results if (r["shape"], r["seq_len"], r["path"]) == (shape, seq_len, path)]
            for r in runs:
                name = f"{path} [{r.get('layout', '?')}]" if len(runs) > 1 else path
                if r.get("status") == "ok":
                    cells.append(f"{name} {r['tokens_per_s_per_gpu']:,.0f} ({100 * r['mfu']:.1f}%)")
                    if path not in fastest or r["tokens_per_s_per_gpu"] > fastest[path]["tokens_per_s_per_gpu"]:
                        fastest[path] = r
                else:
                    cells.append(f"{name} {r.get('status')}")
        rows.append((f"training {shape} @ {seq_len}: tok/s/GPU (MFU)", ", ".join(cells), "MFU >= 45% (8B)"))
        if "megatron" in fastest and "dtensor" in fastest:
            ratio = fastest["megatron"]["tokens_per_s_per_gpu"] / fastest["dtensor"]["tokens_per_s_per_gpu"]
            rows.append((f"  Megatron / DTensor, {shape} @ {seq_len}", f"{ratio:.2f}x", ">= 1.2x"))
    return rows


def _spread(row: dict) -> str:
    """Median tokens/s and the spread over the runs, as `bench_engine.py` writes them."""
    if "tokens_per_s_min" not in row:
        return f"{row['tokens_per_s']:,.0f}"
    return f"{row['tokens_per_s']:,.0f} ({row['tokens_per_s_min']:,.0f}-{row['tokens_per_s_max']:,.0f})"


def engine_rows(record: Any) -> list[tuple[str, str, str]]:
    """Each steady-state engine run (one per decode kernel and block size) and its ratio to each transformers row
    (the same workload: prompts, samples and new tokens), medians of the timed runs with their spread."""
    if not record:
        return [("generation", "failed (see engine.log)", "")]
    engines = [r for r in record if r["system"].startswith("engine (")]
    baselines = [r for r in record if r["system"].startswith("transformers")]
    rows = []
    for engine in engines:
        label = engine["system"].removeprefix("engine ")
        rows.append((f"generation: engine tokens/s {label}", _spread(engine), ""))
        for baseline in baselines:
            name = baseline["system"].removeprefix("transformers ")
            if baseline.get("status", "ok") != "ok":
                rows.append((f"  engine / {name}", baseline["status"], ""))
                continue
            ratio = engine["tokens_per_s"] / baseline["tokens_per_s"]
            goal = ">= 20x" if name == "generate" else ""
            rows.append((f"  engine / {name} (batch {baseline['batch']}, same tokens)", f"{ratio:.1f}x", goal))
    for baseline in baselines:
        if baseline.get("status", "ok") == "ok":
            rows.append((f"generation: {baseline['system']} tokens/s", _spread(baseline), ""))
    for step in (r for r in record if r["system"].startswith("decode step")):
        figure = f"{step['system']}, {step['rows']} x {step['context']} tokens"
        value = f"{step['decode_ms']:.2f} ms; H200 bound {step['bound_ms']:.2f} ms ({step['bound']}): "
        rows.append((figure, value + f"{step['bound_ms'] / step['decode_ms']:.0%} of the limit", ""))
    return rows


def grpo_rows(record: Any) -> list[tuple[str, str, str]]:
    if not record:
        return [("GRPO step", "failed (see grpo.log)", "")]
    phases = record["phases"]
    rows = [
        (f"GRPO step: {label}", f"{phases[key]:.3f} s", "")
        for key, label in (
            ("generation_s", "generation"),
            ("logprobs_s", "log-probs"),
            ("train_s", "training"),
            ("refit_s", "refit"),
            ("step_s", "whole step"),
        )
    ]
    if record.get("d2d_copy_s"):
        ratio = phases["refit_s"] / record["d2d_copy_s"]
        rows.append(("  refit / device-to-device copy", f"{ratio:.1f}x", "<= 3x"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("bench"), help="JSON and logs of every part")
    parser.add_argument("--nproc", type=int, default=1, help="GPUs for the training benchmark")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes on CPU (smoke test)")
    parser.add_argument("--parts", default="training,engine,grpo", help="which parts to run")
    parser.add_argument(
        "--training-time-limit",
        type=float,
        default=0.0,
        help="seconds after which the training part is stopped and reported as far as it got (0: no limit)",
    )
    for part in ("engine", "grpo"):
        parser.add_argument(
            f"--{part}-time-limit",
            type=float,
            default=0.0,
            help=f"seconds after which the {part} part is stopped (0: no limit)",
        )
    parser.add_argument(
        "--training-args",
        default="",
        help='extra arguments for bench_training.py, e.g. "--shapes llama3-8b --seq-lens 4096 --iters 2"',
    )
    parser.add_argument("--engine-args", default="", help="extra arguments for bench_engine.py (e.g. --max-tokens 256)")
    parser.add_argument("--grpo-args", default="", help="extra arguments for bench_grpo.py")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    parts = set(args.parts.split(","))
    tiny = ["--tiny"] if args.tiny else []
    out = args.out.resolve()
    if "training" in parts:
        _run(
            "bench_training.py",
            [
                *tiny,
                "--nproc",
                str(1 if args.tiny else args.nproc),
                *shlex.split(args.training_args),
                "--json",
                str(out / "training.json"),
            ],
            out / "training.log",
            args.training_time_limit,
        )
    if "engine" in parts:
        engine_args = ["--tiny", "--device", "cpu", "--repeats", "2"] if args.tiny else []
        engine_args += shlex.split(args.engine_args)
        _run(
            "bench_engine.py",
            [*engine_args, "--json", str(out / "engine.json")],
            out / "engine.log",
            args.engine_time_limit,
        )
    if "grpo" in parts:
        _run(
            "bench_grpo.py",
            [*tiny, *shlex.split(args.grpo_args), "--work", str(out / "grpo_work"), "--json", str(out / "grpo.json")],
            out / "grpo.log",
            args.grpo_time_limit,
        )
    rows = []
    if "training" in parts:
        rows += training_rows(_load(out / "training.json"))
    if "engine" in parts:
        rows += engine_rows(_load(out / "engine.json"))
    if "grpo" in parts:
        rows += grpo_rows(_load(out / "grpo.json"))
    width = max(len(r[0]) for r in rows)
    print(f"\n{'figure':<{width}}  {'measured':<60}  goal")
    for figure, value, goal in rows:
        print(f"{figure:<{width}}  {value:<60}  {goal}")
    summary = [{"figure": figure, "value": value, "goal": goal} for figure, value, goal in rows]
    (out / "summary.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
