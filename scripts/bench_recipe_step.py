"""A recipe's GRPO step on one GPU, for model shapes too large for it: measured at reduced depths, extrapolated.

For `qwen3-8b` (`examples/grpo_math_qwen3_8b.yaml`) and `qwen3-30b-a3b` (`examples/grpo_math_qwen3_30b_a3b.yaml`):
the recipe's own config, with these changes only, run by `train_grpo` for `--steps` steps at each of the
`--layers` depths (a fresh random bf16 checkpoint of the model's real layer shape, hidden size, heads, experts
and vocabulary each time):
- one GPU: tensor, expert and sequence parallelism off, one rank; the step does ONE REPLICA'S SHARE of the
  recipe's prompts (`num_prompts_per_step` divided by its engine replicas, each with all its samples): the work
  one of the recipe's replicas does, here on one GPU at TP1 where the recipe gives each replica the GPUs of its
  tensor-parallel group;
- every sample is generated to `generation.max_new_tokens` (random weights: no stop token): the step of a batch
  whose completions all reach the recipe's maximum length, an upper bound for generation;
- prompts of `--prompt-tokens` words of a word tokenizer (no chat template), answers scored by the in-process
  `number` reward (math-verify is not on the GPU machine; scoring overlaps generation anyway), no validation, no
  checkpoints; the KV cache sized for every sample at full length.

Each phase's median over the steps after the first (with min-max) is printed per depth, then fitted as
`a + b x layers` (least squares; two depths: the line through them) and the fit evaluated at the model's full
depth. That last column is an EXTRAPOLATION, not a measurement: the full model does not fit one GPU for training
(its weights, gradients and Adam states alone exceed 141 GB), and it assumes every layer costs the same.

On the GPU machine, after installing the project (offline, megatron-core from .whl/):

    TORCH_SPEC= EXTRAS= WHEELS=.whl bash scripts/setup.sh && . .venv/bin/activate
    python scripts/bench_recipe_step.py qwen3-8b --json OUT/qwen3_8b.json           # depths 2 and 6
    python scripts/bench_recipe_step.py qwen3-30b-a3b --json OUT/qwen3_30b_a3b.json  # depths 2 and 4
    python scripts/bench_recipe_step.py qwen3-30b-a3b --sequential-experts --layers 2 --json OUT/qwen3_30b_a3b_seq.json

The trainer runs a MoE model's experts as torch grouped GEMMs on GPU (`megatron/grouped_experts.py`);
`--sequential-experts` runs megatron-core's `SequentialMLP` loop instead, the baseline to compare the training phase
with.

`--json` is rewritten after every depth, so a run cut short keeps the depths it finished. `--smoke` runs the
same plumbing on CPU with a tiny shape and short lengths (for the test; its figures mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

import yaml
from random_checkpoint import SHAPES, write_random_checkpoint

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {
    "qwen3-8b": ("examples/grpo_math_qwen3_8b.yaml", (2, 6)),
    "qwen3-30b-a3b": ("examples/grpo_math_qwen3_30b_a3b.yaml", (2, 4)),
}
"""Model shape -> (its recipe, default depths)."""
PHASES = (
    ("generation_s", "generation (+ scoring)"),
    ("logprobs_s", "log-probs (reference)"),
    ("train_s", "training"),
    ("refit_s", "refit"),
    ("step_s", "whole step"),
)
WORDS = ("[EOS]", *(f"w{i}" for i in range(60)), "[UNK]")
SMOKE_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2}
SMOKE_SHAPE |= {"head_dim": 16, "vocab_size": len(WORDS)}
SMOKE_MOE = {"moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2}
"""`--smoke`: the tiny shape put over the model's (and over a mixture of experts' expert settings)."""


def replica_share(recipe: dict[str, Any]) -> tuple[int, int, int]:
    """(prompts of one engine replica's share, engine replicas, GPUs a replica) of the recipe's step."""
    policy = recipe["policy"]["megatron_cfg"]
    tp = recipe.get("generation", {}).get("tensor_parallel_size") or policy.get("tensor_model_parallel_size", 1)
    replicas = recipe["cluster"]["gpus_per_node"] // tp
    return -(-recipe["grpo"]["num_prompts_per_step"] // replicas), replicas, tp


def one_gpu_config(
    recipe: dict[str, Any], args: argparse.Namespace, model_dir: Path, prompts: Path, layers: int, kv_layer_bytes: int
) -> dict[str, Any]:
    """The recipe as one rank runs it here (see the module docstring)."""
    config = copy.deepcopy(recipe)
    megatron = config["policy"]["megatron_cfg"]
    megatron |= {"tensor_model_parallel_size": 1, "sequence_parallel": False}
    if "expert_model_parallel_size" in megatron:
        megatron |= {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 1}
    if args.sequential_experts:  # the baseline: megatron-core's SequentialMLP, one GEMM pair per local expert
        megatron["transformer"] = {**(megatron.get("transformer") or {}), "moe_grouped_gemm": False}
    if args.recompute:
        megatron["transformer"] = {
            **(megatron.get("transformer") or {}),
            "recompute_granularity": "full",
            "recompute_method": "uniform",
            "recompute_num_layers": 1,
        }
    config["policy"]["model_path"] = str(model_dir)
    config["cluster"] = {"gpus_per_node": 1}
    share, _, _ = replica_share(recipe)
    generation = config["generation"]
    max_new = args.max_new_tokens or generation["max_new_tokens"]
    samples = share * config["grpo"]["num_generations_per_prompt"]
    generation |= {
        "stop_token_ids": [],
        "max_new_tokens": max_new,
        "max_model_len": args.prompt_tokens + max_new,
        "kv_cache_memory_bytes": samples * (args.prompt_tokens + max_new + 64) * kv_layer_bytes * layers + (256 << 20),
    }
    generation.pop("tensor_parallel_size", None)
    # no validation (its prompts would also size the engine's batch slots: `max_num_seqs`)
    config["grpo"] |= {"num_prompts_per_step": share, "max_num_steps": args.steps, "val_period": 0}
    config["grpo"] |= {"val_num_prompts": 0, "val_num_generations": 1}
    config["data"] = {"train_jsonl": str(prompts), "apply_chat_template": False}
    config["reward"] = {"name": "number", "num_workers": 0}
    config["checkpointing"] = {"enabled": False}
    config["logger"] = {"log_dir": str(args.work / f"logs-{layers}"), "print_progress": True}
    if args.smoke:  # CPU: fp32, and megatron-core's all-to-all dispatcher needs CUDA streams
        config["policy"]["dtype"] = "fp32"
        megatron.get("transformer", {}).pop("moe_token_dispatcher_type", None)
        megatron["max_tokens_per_microbatch"] = 256
    return config


def kv_bytes_per_token_and_layer(shape: dict[str, Any], dtype_bytes: int) -> int:
    head_dim = shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_key_value_heads"] * head_dim * dtype_bytes


def fit(depths: list[int], values: list[float], at: int) -> tuple[float, float, float]:
    """(intercept, per layer, value at `at`) of the least-squares line through (depth, value)."""
    mean_x, mean_y = statistics.mean(depths), statistics.mean(values)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(depths, values, strict=True)) / sum(
        (x - mean_x) ** 2 for x in depths
    )
    intercept = mean_y - slope * mean_x
    return intercept, slope, intercept + slope * at


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(RECIPES))
    parser.add_argument("--layers", type=int, nargs="+", help="depths to measure (default: the model's pair)")
    parser.add_argument("--steps", type=int, default=3, help="steps a depth (the first, with warm-up, left out)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, help="default: the recipe's")
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation (if memory asks)")
    parser.add_argument(
        "--sequential-experts",
        action="store_true",
        help="MoE: megatron-core's SequentialMLP instead of the grouped GEMMs (moe_grouped_gemm: false), to compare",
    )
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_recipe_step"))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shape, short lengths, CPU (plumbing only)")
    args = parser.parse_args()

    import torch

    from hf_mcore_bridge.errors import BridgeError
    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    recipe_file, default_depths = RECIPES[args.model]
    recipe = yaml.safe_load((ROOT / recipe_file).read_text())
    shape = dict(SHAPES[args.model])
    full_depth = shape["num_hidden_layers"]
    if args.smoke:
        shape |= SMOKE_SHAPE | (SMOKE_MOE if "num_experts" in shape else {})
        args.max_new_tokens, args.prompt_tokens = args.max_new_tokens or 8, min(args.prompt_tokens, 8)
        recipe["grpo"] |= {"num_prompts_per_step": 4, "num_generations_per_prompt": 2}
    depths = list(dict.fromkeys(args.layers or default_depths))  # one depth: its phases, no per-layer fit
    share, replicas, replica_gpus = replica_share(recipe)
    samples = share * recipe["grpo"]["num_generations_per_prompt"]
    max_new = args.max_new_tokens or recipe["generation"]["max_new_tokens"]
    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda and not args.smoke else torch.float32
    print(
        f"{args.model} ({recipe_file}): one replica's share of {replicas}, {share} prompts x "
        f"{recipe['grpo']['num_generations_per_prompt']} samples x ({args.prompt_tokens} + {max_new}) tokens, "
        f"one {'GPU' if cuda else 'CPU'}, depths {depths} of {full_depth}",
        flush=True,
    )
    args.work.mkdir(parents=True, exist_ok=True)
    prompts = args.work / "prompts.jsonl"
    rows = [" ".join(WORDS[1 + (i + j) % (len(WORDS) - 2)] for j in range(args.prompt_tokens)) for i in range(64)]
    prompts.write_text("".join(json.dumps({"prompt": r, "answer": "0"}) + "\n" for r in rows))
    record: dict[str, Any] = {
        "model": args.model,
        "recipe": recipe_file,
        "args": {k: str(v) for k, v in vars(args).items()},
        "share": {
            "replicas": replicas,
            "replica_gpus": replica_gpus,
            "prompts": share,
            "samples": samples,
            "max_new_tokens": max_new,
        },
        "full_depth": full_depth,
        "depths": {},
    }
    for layers in depths:
        model_dir = args.work / f"model-{layers}"
        started = time.perf_counter()
        nbytes = write_random_checkpoint(model_dir, {**shape, "num_hidden_layers": layers}, dtype=dtype)
        if cuda:
            torch.cuda.empty_cache()  # the checkpoint was drawn on the GPU: leave its memory to the rank
        write_tokenizer(model_dir)
        print(f"{layers} layers: random checkpoint {nbytes / 2**30:.2f} GiB in {time.perf_counter() - started:.0f} s")
        kv = kv_bytes_per_token_and_layer(shape, dtype.itemsize)
        data = one_gpu_config(recipe, args, model_dir, prompts, layers, kv)
        started = time.perf_counter()
        try:
            result = train_grpo(config_from_dict(data))
        except BridgeError as err:  # e.g. out of memory at this depth: keep the others
            print(f"{layers} layers: failed: {err}", flush=True)
            record["depths"][str(layers)] = {"error": str(err)}
        else:
            steady = result.metrics[1:] or result.metrics
            record["depths"][str(layers)] = {
                key: {
                    "median": statistics.median(m[key] for m in steady),
                    "min": min(m[key] for m in steady),
                    "max": max(m[key] for m in steady),
                }
                for key, _ in PHASES
            } | {"wall_s": time.perf_counter() - started, "steps": len(result.metrics)}
        if args.json:
            args.json.write_text(json.dumps(record, indent=2))
    report(record)
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))


def write_tokenizer(directory: Path) -> None:
    """A whitespace word-level `tokenizer.json` over `WORDS`."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def report(record: dict[str, Any]) -> None:
    """Per phase: the median (min-max) at each depth measured, the fitted per-layer cost and the extrapolation."""
    done = {int(d): r for d, r in record["depths"].items() if "error" not in r}
    depths = sorted(done)
    full = record["full_depth"]
    share = record["share"]
    print(
        f"\n{record['model']}: one replica's share ({share['samples']} samples, {share['max_new_tokens']} new tokens "
        f"each) on one device; median (min-max) of the steps after the first, seconds"
    )
    header = "".join(f"{f'{d} layers':>24}" for d in depths)
    print(f"  {'phase':<24}{header}{'per layer':>12}{f'{full} layers (extrapolated)':>30}")
    fits: dict[str, Any] = {}
    for key, label in PHASES:
        cells = "".join(
            f"{done[d][key]['median']:.2f} ({done[d][key]['min']:.2f}-{done[d][key]['max']:.2f})".rjust(24)
            for d in depths
        )
        if len(depths) >= 2:
            intercept, slope, value = fit(depths, [done[d][key]["median"] for d in depths], full)
            fits[key] = {"intercept_s": intercept, "per_layer_s": slope, "extrapolated_s": value}
            print(f"  {label:<24}{cells}{slope:>12.3f}{value:>30.1f}")
        else:
            print(f"  {label:<24}{cells}")
    record["fit"] = fits
    failed = sorted(set(map(int, record["depths"])) - set(depths))
    if failed:
        print(f"  not measured (failed): {failed} layers")
    if len(depths) < 2:
        print("  fewer than two depths measured: no per-layer fit")
        return
    print(
        f"  The last column is an extrapolation (a + b x layers through the measured depths), not a measurement:\n"
        f"  {full} layers do not fit one GPU for training. The recipe runs {share['replicas']} such replicas, each on\n"
        f"  {share['replica_gpus']} GPUs (tensor-parallel), at once: not measured here."
    )


if __name__ == "__main__":
    main()
