"""LoRA against full fine-tuning on the GRPO loop users run: step, training and refit time, refit bytes, side by side.

Runs `scripts/bench_grpo.py` (the product's `train_grpo` on a random checkpoint of a real shape, default the
Llama-3.2-1B shape in bf16) with full weights and with LoRA adapters (`policy.lora`, rank `--rank` on the seven
attention and MLP projections, alpha 2 x rank) refitted two ways: the adapters alone, which the engine applies in
its linears (`lora`, `policy.lora.refit: adapters`), and the adapted projections' merged weights (`lora_merged`,
the default); the three alternately for `--rounds` rounds, each run in a process of its own with
the same arguments otherwise. Each phase is reported as the median over every steady step (steps 2..N
of each run) with its spread (min - max), and LoRA's ratio to full training:

- training (forward, backward and optimizer step: LoRA's backward computes no weight gradient of the frozen
  base, and its optimizer holds the adapters alone);
- refit (full training, one GPU: the refit recorded as a CUDA graph and replayed, `grpo.refit.replay`; LoRA: the
  adapters alone, or each adapted weight merged as W + (alpha / rank) B A, streamed eagerly; the frozen tensors not
  at all);
- the bytes a steady refit streams, and each mode's floor: one device-to-device copy of those bytes;
- the whole step; and the training's model FLOPs per second against the GPU's dense bf16 peak (`--peak-tflops`):
  6 N per token for full training, 4 N for LoRA (no weight gradients; the adapters' own FLOPs, under 2 % at rank
  16 on this shape, are left out), N the parameters of the linear layers (the output layer included; attention
  scores and embeddings left out).

In the project's environment on a GPU machine (`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, `. .venv/bin/activate`):

    python scripts/bench_lora.py                                  # 1B shape, 32 x 8 samples, 256 new tokens
    python scripts/bench_lora.py --rounds 2 --steps 6 --json lora.json
    python scripts/bench_lora.py --tiny                           # CPU smoke run (tiny shape, fp32)

Other arguments are handed to `bench_grpo.py` unchanged (`--tp`, `--shape`, `--max-new-tokens`, ...).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PHASES = (
    ("train_s", "training"),
    ("refit_s", "refit"),
    ("logprobs_s", "log-probs (policy + reference)"),
    ("generation_s", "generation"),
    ("step_s", "whole step"),
)


def linear_parameters(config: dict[str, Any]) -> int:
    """Parameters of a Llama-like model's linear layers (attention, MLP, output layer) from its HF config."""
    hidden, ffn, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or hidden // heads
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return layers * (attention + 3 * hidden * ffn) + config["vocab_size"] * hidden


MODES = {"full": [], "lora": ["--lora-refit", "adapters"], "lora_merged": ["--lora-refit", "merged"]}
"""Each run's mode -> its own `bench_grpo.py` arguments (LoRA's with `--lora-rank`)."""


def run(mode: str, rank: int, rest: list[str], work: Path) -> dict[str, Any]:
    """One `bench_grpo.py` run in its own process; its JSON record."""
    out = work / f"{mode}.json"
    command = [sys.executable, str(HERE / "bench_grpo.py"), *rest, "--work", str(work / mode), "--json", str(out)]
    if mode != "full":
        command += ["--lora-rank", str(rank), *MODES[mode]]
    print(f"\n== {mode}: {' '.join(command[1:])}", flush=True)
    subprocess.run(command, check=True)
    return json.loads(out.read_text())


def summary(records: list[dict[str, Any]], key: str) -> tuple[float, float, float]:
    """Median, min and max of `key` over every steady step (2..N) of the runs."""
    values = [float(m[key]) for r in records for m in r["metrics"][1:]]
    return statistics.median(values), min(values), max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rank", type=int, default=16, help="the adapters' rank")
    parser.add_argument("--rounds", type=int, default=1, help="full and LoRA runs, alternately, this many times each")
    parser.add_argument("--steps", type=int, default=5, help="GRPO steps per run (the first is warm-up)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 / H200 SXM: 989)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_lora"))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run (bench_grpo.py --tiny)")
    args, rest = parser.parse_known_args()
    rest += ["--tiny"] if args.tiny else []
    rest += ["--steps", str(args.steps), "--prompts", str(args.prompts), "--max-new-tokens", str(args.max_new_tokens)]
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for round_ in range(args.rounds):
        for mode in runs:
            runs[mode].append(run(mode, args.rank, rest, args.work / f"round{round_}"))

    first = runs["full"][0]
    samples = int(first["args"]["prompts"]) * int(first["args"]["generations"])
    tokens = samples * (int(first["args"]["prompt_tokens"]) + int(first["args"]["max_new_tokens"]))
    n = linear_parameters(first["model_config"])
    table: dict[str, dict[str, Any]] = {}
    print(f"\nLoRA rank {args.rank} against full weights, {samples} samples x {tokens // samples} tokens a step,")
    print(f"median [min - max] over steps 2..{args.steps} of {args.rounds} run(s) each:")
    modes = list(runs)
    print(f"  {'':<32}" + "".join(f" {m:>22}" for m in modes) + "".join(f" {m + ' / full':>18}" for m in modes[1:]))
    for key, label in PHASES:
        cells = {m: summary(runs[m], key) for m in modes}
        table[key] = {m: cells[m] for m in modes} | {f"{m}/full": cells[m][0] / cells["full"][0] for m in modes[1:]}
        row = "".join(f" {f'{c[0]:8.3f} [{c[1]:.3f}-{c[2]:.3f}]':>22}" for c in cells.values())
        ratios = "".join(f" {cells[m][0] / cells['full'][0]:17.2f}x" for m in modes[1:])
        print(f"  {label:<32}{row}{ratios}")
    streamed = {m: statistics.median(float(r["refit_bytes"]) for r in records) for m, records in runs.items()}
    copy = {m: statistics.median(float(r["d2d_copy_s"]) for r in records) for m, records in runs.items()}
    mib = "".join(f" {streamed[m] / 2**20:>22.1f}" for m in modes)
    print(
        f"  {'bytes a refit streams (MiB)':<32}{mib}"
        + "".join(f" {streamed[m] / streamed['full']:17.4f}x" for m in modes[1:])
    )
    if copy["full"]:
        print(f"  {'floor: one d2d copy of them (s)':<32}" + "".join(f" {copy[m]:>22.5f}" for m in modes))
        print(f"  {'refit / its floor':<32}" + "".join(f" {table['refit_s'][m][0] / copy[m]:>21.1f}x" for m in modes))
        flops = {m: (6 if m == "full" else 4) * n * tokens for m in modes}
        achieved = {m: flops[m] / table["train_s"][m][0] / 1e12 for m in modes}
        print(f"  {'training model TFLOP/s':<32}" + "".join(f" {achieved[m]:>22.0f}" for m in modes))
        print(f"  {'  of the peak':<32}" + "".join(f" {achieved[m] / args.peak_tflops:>22.0%}" for m in modes))
    if args.json:
        record = {"args": vars(args) | {"work": str(args.work), "json": str(args.json)}, "bench_grpo_args": rest}
        args.json.write_text(json.dumps(record | {"phases": table, "refit_bytes": streamed, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
