"""A GRPO step on a real model shape, timed phase by phase, and the refit against a device-to-device copy.

Builds a random bf16 HF checkpoint of a shape from `scripts/random_checkpoint.py` (default Llama-3.2-1B), a word
tokenizer and prompts in code, and runs `bridge train grpo`'s loop (`train_grpo`) for a few steps with
completions of a fixed length (no stop token: every sample runs to `--max-new-tokens`). Reported per phase, the
median over the steps after the first (which includes warm-up: CUDA-graph capture, allocator growth):
generation, log-probs (policy and reference), training, refit (gather + convert, engine load) and the whole step.
On one GPU the refit is recorded as a CUDA graph at the first step and replayed from the second
(`grpo.refit.replay`), so the steady figure is the replay's.
Beside it, in the same command: a device-to-device copy of the policy's bytes in the same dtype, the floor of a
refit (`../shared/FACTS.md`), and the refit's ratio to it.

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/bench_grpo.py                              # 1B shape, 64 x 8 samples, 512 tokens
    python scripts/bench_grpo.py --prompt-tokens 15872 --max-new-tokens 512 --prompts 2 \\
        --generations 4 --recompute                                             # a 16K-token step
    python scripts/bench_grpo.py --shape llama3-8b --tp 2 --gpus 2   # the 8B shape on two GPUs
    python scripts/bench_grpo.py --tiny                                     # CPU smoke run (tiny shape, fp32)
    python scripts/bench_grpo.py --lora-rank 16     # LoRA on the seven projections (`scripts/bench_lora.py`
                                                    # runs it beside full training)

Training and log-prob micro-batches are packed rows of `--max-tokens-per-microbatch` tokens (THD, as
`policy.megatron_cfg.sequence_packing` makes them); `--no-packing` gives padded micro-batches of
`--micro-batch-size` sequences instead.

Assumes one host; `--gpus` ranks (default TP x PP), one engine replica per TP ranks (`generation.tensor_parallel_size`
left at the policy's TP), each generating its share of the prompts: the generation time of each replica and the
refit path taken (shard-local or full tensors) are reported beside the phases. Random weights generate random tokens,
so rewards are 0 and advantages 0: the work per step (tokens generated, log-probs, forward and backward, refit) is
that of a real step of the same lengths, the learning signal is not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from random_checkpoint import SHAPES, TINY_SHAPE, write_random_checkpoint

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
WORDS = ("[EOS]", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "plus", "is", "[UNK]")
PHASES = (
    ("generation_s", "generation"),
    ("logprobs_s", "log-probs (policy + reference)"),
    ("train_s", "training"),
    ("refit_s", "refit"),
    ("refit_gather_s", "  refit: TP/EP gathers"),
    ("refit_transfer_s", "  refit: stages exchanged"),
    ("refit_convert_s", "  refit: mapping table to HF"),
    ("refit_load_s", "  refit: engine load_weights"),
    ("step_s", "whole step"),
)


def write_tokenizer(directory: Path) -> None:
    """A whitespace word-level `tokenizer.json` over `WORDS` (ids far below any real vocabulary)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def write_prompts(path: Path, count: int, prompt_tokens: int) -> None:
    """`count` prompts of exactly `prompt_tokens` words each."""
    words = WORDS[1:-1]
    rows = []
    for i in range(count):
        text = " ".join(words[(i + j) % len(words)] for j in range(prompt_tokens))
        rows.append({"prompt": text, "answer": "0"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def run_config(args: argparse.Namespace, model_dir: Path, prompts: Path) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    samples = args.prompts * args.generations
    transformer: dict[str, Any] = {}
    if args.recompute:
        transformer |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {
        "policy": {
            "model_path": str(model_dir),
            "dtype": "bf16" if cuda else "fp32",
            "megatron_cfg": {
                "tensor_model_parallel_size": args.tp,
                "pipeline_model_parallel_size": args.pp,
                "sequence_parallel": args.tp > 1 and args.sequence_parallel,
                "micro_batch_size": args.micro_batch_size,
                "sequence_packing": args.packing,
                "max_tokens_per_microbatch": args.max_tokens_per_microbatch,
                "transformer": transformer,
                "optimizer": {"lr": 1e-6, "use_distributed_optimizer": args.distributed_optimizer},
            },
            "lora": {
                "enabled": args.lora_rank > 0,
                "rank": max(args.lora_rank, 1),
                "alpha": 2.0 * max(args.lora_rank, 1),
                "target_modules": args.lora_targets,
                "refit": args.lora_refit,
            },
        },
        "grpo": {
            "num_prompts_per_step": args.prompts,
            "num_generations_per_prompt": args.generations,
            "max_num_steps": args.steps,
        },
        "loss_fn": {"kl_coef": args.kl_coef},
        "generation": {
            "stop_token_ids": [],  # every completion runs to max_new_tokens: a fixed token count per step
            "max_new_tokens": args.max_new_tokens,
            "max_model_len": args.prompt_tokens + args.max_new_tokens,
            "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30),
        },
        "data": {"train_jsonl": str(prompts)},
        # rewards are 0 anyway; `number` needs no sympy (math-verify is not on the GPU machine) and costs nothing
        "reward": {"name": "number", "num_workers": 0},
        "logger": {"log_dir": str(args.work / "logs"), "print_progress": True},
        "cluster": {"gpus_per_node": args.gpus or None},
        "_samples": samples,
    }


def d2d_copy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Median time of one device-to-device copy of `nbytes` (the refit's floor); 0 without CUDA."""
    if not torch.cuda.is_available():
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(repeats + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama3.2-1b", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, help="override the shape's number of layers")
    parser.add_argument("--tiny", action="store_true", help="a tiny fp32 shape (CPU smoke run)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_grpo"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=512)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=0, help="ranks to start (0: TP x PP)")
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--distributed-optimizer", action="store_true")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument(
        "--packing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="pack sequences into rows of --max-tokens-per-microbatch (THD); --no-packing: padded micro-batches",
    )
    parser.add_argument("--max-tokens-per-microbatch", type=int, default=16384)
    parser.add_argument("--recompute", action="store_true", help="full activation recomputation, layer by layer")
    parser.add_argument("--kl-coef", type=float, default=0.01)
    parser.add_argument("--kv-cache-gib", type=float, default=16.0)
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0: full weights)")
    parser.add_argument(
        "--lora-targets",
        type=lambda text: text.split(","),
        default=list(LORA_TARGETS),
        help="comma-separated HF projections the adapters target (with --lora-rank)",
    )
    parser.add_argument(
        "--lora-refit",
        choices=("merged", "adapters"),
        default="merged",
        help="what LoRA refits stream: the adapters (the engine applies them) or merged weights",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.generations, args.max_new_tokens, args.steps = 2, 2, 8, 2
        args.kv_cache_gib = 0.0625

    from hf_mcore_bridge.grpo.run.config import config_from_dict
    from hf_mcore_bridge.grpo.run.trainer import train_grpo

    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "model"
    config = dict(TINY_SHAPE if args.tiny else SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    started = time.perf_counter()
    nbytes = write_random_checkpoint(model_dir, config, dtype=dtype)
    write_tokenizer(model_dir)
    print(f"random checkpoint: {nbytes / 2**30:.2f} GiB in {time.perf_counter() - started:.1f} s", flush=True)
    prompts = args.work / "prompts.jsonl"
    write_prompts(prompts, max(args.prompts, 8), args.prompt_tokens)
    data = run_config(args, model_dir, prompts)
    samples = data.pop("_samples")
    result = train_grpo(config_from_dict(data))
    steady = result.metrics[1:] or result.metrics
    phases = {key: statistics.median(float(m[key]) for m in steady) for key, _ in PHASES}
    # the refit's floor: one copy of the bytes a steady refit streams (all of them; with LoRA the adapted weights)
    streamed = int(statistics.median(float(m.get("refit_bytes", nbytes)) for m in steady)) or nbytes
    copy_s = d2d_copy_seconds(streamed)
    tokens = samples * (args.prompt_tokens + args.max_new_tokens)
    print(f"\nGRPO step, {samples} samples x ({args.prompt_tokens} prompt + {args.max_new_tokens} new) tokens,")
    what = f"LoRA rank {args.lora_rank}, refit {args.lora_refit}" if args.lora_rank else "full weights"
    layout = f"tp={args.tp} pp={args.pp} ranks={args.gpus or args.tp * args.pp}"
    print(f"median of steps 2..{result.steps} ({what}, {layout}):")
    for key, label in PHASES:
        print(f"  {label:<34} {phases[key]:9.3f} s")
    print(f"  {'tokens / s (whole step)':<34} {tokens / phases['step_s']:9.0f}")
    if copy_s:
        ratio = phases["refit_s"] / copy_s
        print(f"  {'device-to-device copy, same bytes':<34} {copy_s:9.4f} s  (refit = {ratio:.1f}x the copy)")
    print(f"  {'bytes a refit streams':<34} {streamed / 2**20:9.1f} MiB  ({streamed / nbytes:.1%} of the checkpoint)")
    replicas = int(steady[0].get("generation_replicas", 1))
    per_replica = {
        f"generation_replica{r}_s": statistics.median(float(m[f"generation_replica{r}_s"]) for m in steady)
        for r in range(replicas)
        if replicas > 1
    }
    for r, seconds in enumerate(per_replica.values()):
        print(f"  {f'  generation: replica {r}':<34} {seconds:9.3f} s")
    local = all(m.get("refit_shard_local") == 1 for m in steady)
    path = "shard-local (each rank its own shards)" if local else "full tensors (gathered, each engine its part)"
    print(f"  engine replicas: {replicas}; refit path: {path}")
    replayed = sum(int(m.get("refit_replayed", 0)) for m in steady)
    print(f"  refits replayed from their recording (`refit.replay`): {replayed} of {len(steady)}")
    print(f"  every metric of every step: {result.log_dir / 'metrics.jsonl'}")
    if args.json:
        record = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "phases": phases | per_replica,
            "d2d_copy_s": copy_s,
            "refit_bytes": streamed,
            "checkpoint_bytes": nbytes,
            "model_config": config,
            "engine_replicas": replicas,
            "refit_shard_local": local,
        }
        args.json.write_text(json.dumps(record | {"metrics": result.metrics}, indent=2))


if __name__ == "__main__":
    main()
