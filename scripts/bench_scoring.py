r"""Scoring overlapped with generation against scoring after it, on CPU, with a reward that costs real time.

Two measurements, each alternating `reward.overlap` off ("after") and on ("overlapped") and printing per mode the
median (min-max) and the overlapped/after ratio of the medians:
1. The rollout phase, in this process: the embedded engine (a small random Llama written here, `--threads` torch
   threads) generates a step's samples and the trainer's own `_generate_scored` scores them in the reward
   workers, `--rounds` times a mode; timed are generation and scoring together (the step's `generation_s`: the
   only part of a step that overlap changes) and the wait for scores after the engine returned
   (`reward_wait_s`). Both modes of a round use the same seed, so their rewards must be equal (checked).
   With `--control` (the default) it is run again with a reward that sleeps math-verify's mean cost a sample
   and computes nothing: what overlap gives where the reward's work does not take the engine's cores.
2. Whole GRPO steps (`--trainer-runs`, 0 to skip): `bridge train grpo`'s loop (`train_grpo`, megatron-core, one
   rank) on the same model, `--steps` a run, the first step of each run left out; the whole step (`step_s`),
   `generation_s` and `reward_wait_s`, and the rewards compared step by step. The rank sets its own torch threads
   (all the cores), so on a machine with few cores the workers take cores from the engine while it generates.

The reward is math-verify on realistic answers (`realistic_math_reward`): the random model's completions are random
words, so each completion is mapped, by a hash of its text, to a worked answer from `TEMPLATES` (a few sentences
of reasoning ending in a `\boxed{}` or `####` answer: polynomials, fractions and decimals, radicals, intervals,
sums, trigonometric identities, percentages, matrices, logarithms, complex numbers, GSM8K numbers; some of them
wrong) with numbers drawn from the same hash, so answers differ from sample to sample and math-verify's caches
do not make them cheaper than real ones. `math_verify_reward` scores it against its reference in the reward
workers, under the usual per-sample limit. What a sample costs to score is printed first (median and range, in
this process). A stop word ends a completion with probability about 1 / `--words` a token, so lengths vary up to
`--max-new-tokens`, as real ones do.

    python scripts/bench_scoring.py                          # 8 prompts x 8 samples, 1 worker, 1 engine thread
    python scripts/bench_scoring.py --workers 2 --rounds 9 --trainer-runs 0 --json scoring.json

On a GPU machine generation leaves the host's other cores to the workers; measurement 1 with `--threads 1` and
workers on the other cores is the closer picture of that, measurement 2 the plain CPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

TEMPLATES: tuple[Callable[[int], tuple[str, str]], ...] = (
    lambda k: (
        rf"Expanding the square term by term, $(x+{k})^2 = x^2 + 2\cdot {k} x + {k}^2$. "
        rf"So the expression is $\boxed{{x^2+{2 * k}x+{k * k}}}$.",
        rf"(x+{k})^2",
    ),
    lambda k: (
        rf"Expanding, $(x+{k})^2 = x^2 + {2 * k + 1}x + {k * k}$, hence $\boxed{{x^2+{2 * k + 1}x+{k * k}}}$.",
        rf"(x+{k})^2",  # wrong: a slipped coefficient
    ),
    lambda k: (
        rf"Of the {4 * k} marbles, {k} are red, so the probability is $\frac{{{k}}}{{{4 * k}}}$, "
        rf"that is $\boxed{{\dfrac{{1}}{{4}}}}$.",
        "0.25",
    ),
    lambda k: (
        rf"Since $\sqrt{{{2 * k * k}}} = \sqrt{{{k * k}}}\cdot\sqrt{{2}}$, "
        rf"the side length is $\boxed{{{k}\sqrt{{2}}}}$.",
        rf"\sqrt{{{2 * k * k}}}",
    ),
    lambda k: (
        rf"The quadratic $(x+{k})(x-{k + 1}) > 0$ is positive outside its roots, "
        rf"so $x \in \boxed{{(-\infty, -{k}) \cup ({k + 1}, \infty)}}$.",
        rf"(-\infty,-{k})\cup({k + 1},\infty)",
    ),
    lambda k: (
        rf"Summing the arithmetic series, $\sum_{{i=1}}^{{n}} (i + {k}) = \boxed{{\frac{{n(n+{2 * k + 1})}}{{2}}}}$.",
        rf"\frac{{n^2+{2 * k + 1}n}}{{2}}",
    ),
    lambda k: (
        rf"Using $\sin^2 x + \cos^2 x = 1$, the expression is $\boxed{{{k}\sin^2 x + {k}\cos^2 x}}$.",
        f"{k}",
    ),
    lambda k: (
        rf"She keeps {k} of every 100 dollars she earns, so she saves $\boxed{{{k}\%}}$ of her income.",
        f"{k / 100}",
    ),
    lambda k: (
        rf"Multiplying out, the product is $\boxed{{\begin{{pmatrix}} {k} & 1 \\ 0 & {k} \end{{pmatrix}}}}$.",
        rf"\begin{{pmatrix}}{k}&1\\0&{k}\end{{pmatrix}}",
    ),
    lambda k: (
        rf"Since $2^{{{k % 10 + 1}}} = {2 ** (k % 10 + 1)}$, we get $\log_2 {2 ** (k % 10 + 1)} = "
        rf"\boxed{{{k % 10 + 1}}}$.",
        f"{k % 10 + 1}",
    ),
    lambda k: (
        rf"Adding the real and imaginary parts separately gives $\boxed{{{k}+{k}i}}$.",
        rf"{k}i+{k}",
    ),
    lambda k: (
        f"Natalia sold {k} clips in April and {6 * k} in May.\nShe sold {k} + {6 * k} = {7 * k} clips.\n#### {7 * k}",
        f"#### {7 * k}",
    ),
    lambda k: (
        rf"The roots satisfy $x^2 - {2 * k}x + {k * k - 1} = 0$, so $x = {k} \pm 1$, "
        rf"that is $\boxed{{{k - 1}, {k + 1}}}$.",
        rf"{k + 1}, {k - 1}",
    ),
    lambda k: (
        rf"Rationalising, $\frac{{{k}}}{{\sqrt{{2}}}} = \boxed{{\frac{{{k}\sqrt{{2}}}}{{2}}}}$.",
        rf"\frac{{{k}}}{{\sqrt2}}",
    ),
)
"""Worked answers of one shape each, as `k -> (completion, reference)`."""


def realistic_answer(completion: str) -> tuple[str, str]:
    """The worked answer and reference a completion stands for: picked, with its numbers, by a hash of its text."""
    digest = zlib.crc32(completion.encode())
    return TEMPLATES[digest % len(TEMPLATES)]((digest // len(TEMPLATES)) % 97 + 2)


def realistic_math_reward(completion: str, answer: str) -> float:
    """`math_verify_reward` of the worked answer `completion` stands for (`answer` is not used)."""
    from hf_mcore_bridge.grpo.data.rewards import math_verify_reward

    return math_verify_reward(*realistic_answer(completion))


def sleeping_reward(completion: str, answer: str) -> float:
    """1.0 after sleeping `$BENCH_SCORING_SLEEP_S` seconds: a reward that takes time but no core (the control)."""
    time.sleep(float(os.environ["BENCH_SCORING_SLEEP_S"]))
    return 1.0


def reward_cost(samples: int) -> list[float]:
    """Seconds `realistic_math_reward` takes on `samples` distinct completions, in this process."""
    realistic_math_reward("warm", "")
    seconds = []
    for i in range(samples):
        started = time.perf_counter()
        realistic_math_reward(f"sample {i}", "")
        seconds.append(time.perf_counter() - started)
    return seconds


def write_tokenizer(directory: Path, words: list[str]) -> None:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tokenizer = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[-1]))
    tokenizer.pre_tokenizer = Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))


def run_config(args: argparse.Namespace, model_dir: Path, prompts: Path, log_dir: Path, overlap: bool) -> Any:
    from hf_mcore_bridge.grpo.run.config import config_from_dict

    return config_from_dict(
        {
            "policy": {"model_path": str(model_dir), "dtype": "fp32", "megatron_cfg": {"micro_batch_size": 16}},
            "grpo": {
                "num_prompts_per_step": args.prompts,
                "num_generations_per_prompt": args.generations,
                "max_num_steps": args.steps,
            },
            "loss_fn": {"kl_coef": 0.0},
            "generation": {
                "stop_token_ids": [0],
                "max_new_tokens": args.max_new_tokens,
                "max_model_len": args.max_new_tokens + 16,
            },
            "data": {"train_jsonl": str(prompts)},
            "reward": {
                "name": "bench_scoring:realistic_math_reward",
                "num_workers": args.workers,
                "timeout_s": args.timeout_s,
                "overlap": overlap,
            },
            "logger": {"log_dir": str(log_dir), "print_progress": False},
        }
    )


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def rollout_rounds(args: argparse.Namespace, model_dir: Path, prompts: list[str], reward: Any) -> dict[str, Any]:
    """Measurement 1 (see the module docstring) with `reward`: per mode, each round's (generation + scoring, wait)
    seconds and rewards."""
    from types import SimpleNamespace

    import torch
    from tokenizers import Tokenizer

    from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
    from hf_mcore_bridge.engine.engine import iter_safetensors
    from hf_mcore_bridge.grpo.data.scoring import RewardScorer
    from hf_mcore_bridge.grpo.run.trainer import _generate_scored

    torch.set_num_threads(args.threads)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    samples = args.prompts * args.generations
    config = EngineConfig(
        dtype=torch.float32,
        device="cpu",
        max_num_seqs=samples,
        max_model_len=args.max_new_tokens + 16,
        kv_cache_memory_bytes=1 << 30,
    )
    engine = Engine(json.loads((model_dir / "config.json").read_text()), config, tokenizer=tokenizer)
    engine.load_weights(iter_safetensors(model_dir))
    ids = [tokenizer.encode(p).ids for p in prompts[: args.prompts]]
    answers = ["0"] * samples
    out: dict[str, Any] = {
        mode: {"generation_s": [], "engine_s": [], "reward_wait_s": [], "rewards": [], "tokens": []} for mode in MODES
    }
    with RewardScorer(reward, args.workers, args.timeout_s) as scorer:
        scorer.score(["warm"] * max(1, args.workers), ["0"] * max(1, args.workers))  # workers up and warm
        for round_ in range(args.rounds + 1):  # round 0 warms the engine up and is left out
            order = list(MODES) if round_ % 2 else list(reversed(MODES))
            for mode in order:
                ctx = SimpleNamespace(
                    replicas=SimpleNamespace(tp_rank=0),
                    config=SimpleNamespace(reward=SimpleNamespace(overlap=MODES[mode])),
                    engine=engine,
                    scorer=scorer,
                )
                params = SamplingParams(
                    n=args.generations, max_tokens=args.max_new_tokens, stop_token_ids=(0,), seed=round_
                )
                started = time.perf_counter()
                outputs, scored, wait_s = _generate_scored(ctx, ids, params, answers)  # type: ignore[arg-type]
                seconds = time.perf_counter() - started
                if round_:
                    out[mode]["generation_s"].append(seconds)
                    out[mode]["engine_s"].append(seconds - wait_s)
                    out[mode]["reward_wait_s"].append(wait_s)
                    out[mode]["rewards"].append(scored.rewards)
                    out[mode]["tokens"] += [len(s.token_ids) for o in outputs for s in o.samples]
    return out


MODES = {"after": False, "overlapped": True}
"""`reward.overlap` of each mode."""


def print_table(title: str, rows: dict[str, dict[str, list[float]]], keys: tuple[tuple[str, str], ...]) -> dict:
    table = {mode: {key: summary(rows[mode][key]) for key, _ in keys} for mode in MODES}
    print(f"\n{title}; median (min-max):")
    print(f"  {'':<22}" + "".join(f"{mode:>28}" for mode in MODES) + f"{'overlapped / after':>22}")
    for key, label in keys:
        cells = [table[mode][key] for mode in MODES]
        text = "".join(f"{c['median']:.3f} s ({c['min']:.3f}-{c['max']:.3f})".rjust(28) for c in cells)
        ratio = cells[1]["median"] / cells[0]["median"] if cells[0]["median"] > 0 else float("nan")
        print(f"  {label:<22}{text}{ratio:>22.2f}")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench_scoring"))
    parser.add_argument("--rounds", type=int, default=7, help="rollout phases a mode (measurement 1)")
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads (measurement 1)")
    parser.add_argument("--trainer-runs", type=int, default=1, help="train_grpo runs a mode (measurement 2)")
    parser.add_argument("--steps", type=int, default=4, help="steps a trainer run (the first is left out)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--words", type=int, default=48, help="the vocabulary (one of them the stop word)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--workers", type=int, default=1, help="reward.num_workers")
    parser.add_argument("--timeout-s", type=float, default=5.0, help="reward.timeout_s")
    parser.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measurement 1 again with a reward that sleeps math-verify's mean cost (takes no core)",
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    import torch
    from random_checkpoint import TINY_SHAPE, write_random_checkpoint

    cost = reward_cost(64)
    print(
        f"reward: math-verify on worked answers, {1e3 * statistics.median(cost):.1f} ms a sample "
        f"(median of {len(cost)}, {1e3 * min(cost):.1f}-{1e3 * max(cost):.1f} ms) in this process",
        flush=True,
    )
    args.work.mkdir(parents=True, exist_ok=True)
    model_dir = args.work / "model"
    words = ["[EOS]", *(f"w{i}" for i in range(args.words - 2)), "[UNK]"]
    shape = dict(TINY_SHAPE, vocab_size=len(words), hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    shape |= {"num_hidden_layers": args.layers, "num_attention_heads": max(4, args.hidden // 64)}
    shape["num_key_value_heads"] = shape["num_attention_heads"] // 2
    write_random_checkpoint(model_dir, shape, dtype=torch.float32)
    write_tokenizer(model_dir, words)
    texts = [" ".join(words[1 + (i + j) % (len(words) - 2)] for j in range(8)) for i in range(64)]
    prompts = args.work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": t, "answer": "0"}) + "\n" for t in texts))
    samples = args.prompts * args.generations
    keys = (("generation_s", "generation + scoring"), ("reward_wait_s", "wait for scores"))
    phase_keys = (*keys, ("engine_s", "engine's generate"))
    record: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "reward_cost_s": summary(cost)}

    rounds = rollout_rounds(args, model_dir, texts, realistic_math_reward)
    same = rounds["after"]["rewards"] == rounds["overlapped"]["rewards"]
    title = (
        f"1. rollout phase in this process: {samples} samples, {args.workers} reward worker(s), "
        f"{args.threads} engine thread(s), {args.rounds} rounds a mode"
    )
    record["rollout_phase"] = print_table(title, rounds, phase_keys)
    tokens = rounds["after"]["tokens"]
    record["completion_tokens"] = {"mean": statistics.mean(tokens), "max": max(tokens)}
    print(f"  completions: {statistics.mean(tokens):.1f} tokens on average, at most {max(tokens)}")
    print(f"  rewards equal in both modes, round by round: {'yes' if same else 'NO'}")
    if args.control:
        mean = statistics.mean(cost)
        os.environ["BENCH_SCORING_SLEEP_S"] = str(mean)  # before the workers start: they inherit it
        control = rollout_rounds(args, model_dir, texts, sleeping_reward)
        title = (
            f"1b. control: the same with a reward that sleeps {1e3 * mean:.1f} ms a sample (math-verify's mean cost "
            "above) and takes no core"
        )
        record["rollout_phase_control"] = print_table(title, control, phase_keys)

    if args.trainer_runs:
        from hf_mcore_bridge.grpo.run.trainer import train_grpo

        steady: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
        series: dict[str, list[list[float]]] = {mode: [] for mode in MODES}
        for run in range(args.trainer_runs):
            for mode, overlap in MODES.items():
                started = time.perf_counter()
                result = train_grpo(run_config(args, model_dir, prompts, args.work / f"logs-{mode}-{run}", overlap))
                for key in ("step_s", "generation_s", "reward_wait_s", "reward_timeouts"):
                    steady[mode].setdefault(key, []).extend(result.series(key)[1:])
                series[mode].append(result.series("reward_mean"))
                print(
                    f"trainer run {run + 1}/{args.trainer_runs}, scoring {mode}: {time.perf_counter() - started:.1f} s"
                )
        trainer_same = series["after"] == series["overlapped"]
        same = same and trainer_same
        steps = len(steady["after"]["step_s"])
        title = (
            f"2. GRPO steps (train_grpo, one rank): {samples} samples, {args.workers} reward worker(s), "
            f"{steps} steps a mode"
        )
        record["trainer_steps"] = print_table(title, steady, (("step_s", "whole step"), *keys))
        timeouts = {mode: sum(steady[mode]["reward_timeouts"]) for mode in MODES}
        print(f"  timeouts: {timeouts}; rewards equal in both modes, step by step: {'yes' if trainer_same else 'NO'}")
    record["rewards_equal"] = same
    if args.json:
        args.json.write_text(json.dumps(record, indent=2))
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()
