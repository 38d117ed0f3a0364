"""Throughput of the embedded engine against transformers, on the same model, GPU, run and token count.

Default shape: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256, tied
embeddings, llama3 RoPE scaling), random bf16 weights, 64 prompts x 8 samples, 512 new tokens each, EOS ignored.
Every system gets exactly that workload (the same prompts, samples and `--max-tokens` new tokens, forced):
- the engine (one per `--decode-attention` x `--block-size` x `--compile`), after a warm-up and a first run that
  captures the CUDA graphs of longer contexts;
- transformers `generate` (the prompts left-padded into one batch, `num_return_sequences`, `min_new_tokens`);
- transformers' own continuous batching, `generate_batch` (paged KV cache; each prompt given n times), on CUDA
  (`--continuous-batching on` elsewhere; on CPU its background loop makes a smoke test slow). Where the installed
  transformers lacks it or it fails, its row says so and the run goes on.
Each is timed `--repeats` times (3): the table gives the median with the spread (slowest-fastest run), and every
engine / transformers ratio is of medians, with the range the runs allow. Beside each profiled decode step the
script prints its H200 bound (`roofline.py`: the bytes of weights and KV cache read per step at 4.3 TB/s, or its
FLOPs at 790 TFLOP/s, whichever takes longer) and the fraction of that bound the measured step reaches.

In the project's environment (`scripts/setup.sh`; on a GPU machine `TORCH_SPEC= EXTRAS= bash scripts/setup.sh`,
then `. .venv/bin/activate`):

    python scripts/bench_engine.py                          # the full benchmark (CUDA)
    python scripts/bench_engine.py --check                  # tiny fp32 correctness checks on the device
    python scripts/bench_engine.py --tiny --device cpu      # the whole benchmark on a tiny shape (CPU smoke test)

`--check` compares the engine's greedy tokens with transformers `generate` and its log-probs with a transformers
forward pass, and on CUDA compares CUDA-graph decode with eager decode; it exits non-zero on a mismatch.

`--decode-attention triton --decode-attention flex` (and `--block-size 16 --block-size 32`) time one engine per
kernel and block size in the same run, each against the same transformers rows.

`--compile on --compile off` times the engine with and without its `torch.compile`d pointwise steps and sampler.

Figures (and what limits them): `docs/PERFORMANCE.md`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import typer
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline import decode_step_bound

from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams
from hf_mcore_bridge.engine.kv_cache import blocks_for
from hf_mcore_bridge.engine.sampling import SamplingBatch, inverse_cdf_sample, sample
from hf_mcore_bridge.engine.scheduler import DecodeStep

ROPE_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama_1b_config() -> LlamaConfig:
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        rope_parameters=ROPE_LLAMA3,
    )


def tiny_config() -> LlamaConfig:
    """Same architecture, tiny; a short original context so the llama3 scaling matters at short lengths."""
    return LlamaConfig(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_parameters={**ROPE_LLAMA3, "factor": 8.0, "original_max_position_embeddings": 32},
    )


def build_hf(config: LlamaConfig, dtype: torch.dtype, device: str, seed: int = 0) -> PreTrainedModel:
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_prompts(count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (count,), generator=generator).tolist()
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Row:
    """One system's timed runs of the same workload: the median run, and the fastest and slowest."""

    system: str
    batch: int
    new_tokens: int
    total_tokens: int
    seconds: float
    """Median of the timed runs."""
    seconds_min: float
    seconds_max: float
    runs: int
    status: str = "ok"
    """"ok", or what went wrong (the row's figures are then not comparable)."""

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.seconds

    def record(self) -> dict:
        """The row as written to the JSON, with tokens/s at the median and over the spread."""
        spread = {"tokens_per_s_min": self.total_tokens / self.seconds_max}
        spread["tokens_per_s_max"] = self.total_tokens / self.seconds_min
        return dataclasses.asdict(self) | {"tokens_per_s": self.tokens_per_s} | spread


def timed_row(system: str, batch: int, new_tokens: int, run: Callable[[], int], repeats: int, device: str) -> Row:
    """`run` (which returns the tokens it generated) timed `repeats` times; the median and spread. Every run must
    generate the same tokens, else the row is marked."""
    seconds, totals = [], []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        totals.append(run())
        sync(device)
        seconds.append(time.perf_counter() - start)
    status = "ok" if len(set(totals)) == 1 and totals[0] == batch * new_tokens else f"generated {totals} tokens"
    return Row(
        system, batch, new_tokens, totals[0], statistics.median(seconds), min(seconds), max(seconds), repeats, status
    )


def time_engine(
    engine: Engine, prompts: list[list[int]], n: int, max_tokens: int, device: str, repeats: int
) -> list[Row]:
    """A short warm-up, then one run that also captures the CUDA graphs of longer contexts ("first run"), then
    `repeats` runs: the steady state of an engine reused across generate calls (as in RL)."""
    engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=8, seed=1))
    params = SamplingParams(
        n=n, temperature=1.0, max_tokens=max_tokens, seed=0
    )  # no stop tokens: every sample runs to max_tokens

    def run() -> int:
        outputs = engine.generate(prompts, params)
        return sum(len(s.token_ids) for o in outputs for s in o.samples)

    batch = len(prompts) * n
    return [
        timed_row("engine, first run", batch, max_tokens, run, 1, device),
        timed_row("engine", batch, max_tokens, run, repeats, device),
    ]


def time_hf(
    model: PreTrainedModel, prompts: list[list[int]], n: int, new_tokens: int, device: str, repeats: int
) -> Row:
    """transformers `generate` on the engine's workload: the same prompts (left-padded into one batch), `n`
    samples each (`num_return_sequences`), exactly `new_tokens` new tokens (EOS never stops it)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)

    def run(tokens: int) -> int:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                num_return_sequences=n,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                pad_token_id=0,
            )
        return (out.shape[1] - width) * out.shape[0]

    run(2)  # warm-up
    return timed_row("transformers generate", len(prompts) * n, new_tokens, lambda: run(new_tokens), repeats, device)


def time_generate_batch(
    model: PreTrainedModel, prompts: list[list[int]], n: int, new_tokens: int, device: str, repeats: int
) -> Row:
    """transformers' own continuous batching (`generate_batch`: a paged KV cache, requests scheduled as they
    finish) on the engine's workload: each prompt given `n` times (no reliance on its `num_return_sequences`),
    exactly `new_tokens` new tokens each (no EOS token). A failure is reported in the row, not raised."""
    from transformers import GenerationConfig

    inputs = [prompt for prompt in prompts for _ in range(n)]
    system = "transformers generate_batch (continuous batching)"

    def run(tokens: int) -> int:
        config = GenerationConfig(
            max_new_tokens=tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None
        )
        with torch.no_grad():
            outputs = model.generate_batch(inputs=inputs, generation_config=config, progress_bar=False)
        return sum(len(output.generated_tokens) for output in outputs.values())

    try:
        run(2)  # warm-up
        return timed_row(system, len(inputs), new_tokens, lambda: run(new_tokens), repeats, device)
    except Exception as err:  # an API this transformers lacks, or a failure inside it: reported, the run goes on
        message = f"error: {type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
        return Row(system, len(inputs), new_tokens, 0, math.nan, math.nan, math.nan, 0, message)


def synthetic_decode_step(engine: Engine, rows: int, context: int) -> DecodeStep:
    """A decode step of `rows` sequences, each at `context` tokens, over the engine's cache blocks (no sequences
    behind it: for timing the step's kernels)."""
    block_size = engine.config.block_size
    n_blocks = blocks_for(context, block_size)
    tables = (torch.arange(rows * n_blocks, dtype=torch.int32).view(rows, n_blocks) % (engine.num_blocks - 1)) + 1
    last = (context - 1) % block_size
    return DecodeStep(
        sequences=[],
        input_ids=[1] * rows,
        positions=[context - 1] * rows,
        slots=[int(b) * block_size + last for b in tables[:, -1]],
        context_lens=[context] * rows,
        block_tables=tables,
        copies=[],
    )


def profile_decode(
    engine: Engine, hf_config: LlamaConfig, rows: int, contexts: list[int], device: str
) -> list[dict[str, object]]:
    """Milliseconds of one decode step (input copy + model, graph replay on CUDA) and of sampling, at `rows`
    sequences of each context length; the difference to the engine's mean step time is host-side work. Beside each
    decode step: its H200 bound (`roofline.decode_step_bound`: weights and KV read at 4.3 TB/s, or FLOPs at 790
    TFLOP/s, whichever is slower) and the bound over the measured time (the fraction of the limit reached).
    Returns one record per context: the decode step's time, its bound and which limit binds."""
    element = torch.empty(0, dtype=engine.config.dtype).element_size()
    header = (
        f"{'context':>8}{'decode ms':>11}{'H200 bound ms':>15}{'of bound':>10}{'eager sample ms':>17}"
        f"{'engine sampler ms':>19}{'flat-cdf draw ms':>18}{'2-level draw ms':>17}"
    )
    print(f"{header}   (rows={rows})")
    records: list[dict[str, object]] = []
    for context in contexts:
        step = synthetic_decode_step(engine, rows, context)
        batch = SamplingBatch(
            temperature=torch.ones(rows, device=device),
            top_k=torch.zeros(rows, dtype=torch.int64, device=device),
            top_p=torch.ones(rows, device=device),
            uniforms=torch.rand(rows, dtype=torch.float64, device=device),
            any_random=True,
            any_greedy=False,
            any_truncation=False,
        )
        with torch.inference_mode():
            decode_ms = _time_ms(lambda step=step: engine._run_decode(step), device)
            logits = engine._run_decode(step).float()
            sample_ms = _time_ms(lambda logits=logits, batch=batch: sample(logits, batch), device)
            sampler_ms = _time_ms(lambda logits=logits, batch=batch: engine._sampler(logits, batch), device)
            logprobs = torch.log_softmax(logits, dim=-1)
            uniforms = batch.uniforms
            draws = [
                _time_ms(lambda c=c, lp=logprobs, u=uniforms: inverse_cdf_sample(lp, None, u, chunk=c), device)
                for c in (logprobs.shape[1], 1024)
            ]
        bound = decode_step_bound(hf_config, rows, context, element)
        limit_ms = bound.limit_s * 1e3
        print(
            f"{context:>8}{decode_ms:>11.2f}{limit_ms:>15.3f}{limit_ms / decode_ms:>9.0%} "
            f"{sample_ms:>17.2f}{sampler_ms:>19.2f}{draws[0]:>18.2f}{draws[1]:>17.2f}  ({bound.bound} bound)"
        )
        records.append(
            {"rows": rows, "context": context, "decode_ms": decode_ms, "bound_ms": limit_ms, "bound": bound.bound}
        )
    return records


def _time_ms(fn: Callable[[], object], device: str, repeats: int = 10) -> float:
    for _ in range(3):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync(device)
    return (time.perf_counter() - start) / repeats * 1e3


def print_table(rows: list[Row]) -> None:
    """Median tokens/s of each system and the spread (slowest-fastest run) over its runs."""
    header = f"{'system':<52}{'batch':>7}{'new tok/seq':>13}{'tokens':>10}{'median s':>10}{'runs':>6}"
    print(f"{header}{'tokens/s':>12}{'spread tokens/s':>22}  status")
    for r in rows:
        if r.status.startswith("error"):
            dashes = f"{'-':>10}{'-':>10}{r.runs:>6}{'-':>12}{'-':>22}"
            print(f"{r.system:<52}{r.batch:>7}{r.new_tokens:>13}{dashes}  {r.status}")
            continue
        spread = f"{r.total_tokens / r.seconds_max:,.0f}-{r.total_tokens / r.seconds_min:,.0f}"
        print(
            f"{r.system:<52}{r.batch:>7}{r.new_tokens:>13}{r.total_tokens:>10}{r.seconds:>10.2f}{r.runs:>6}"
            f"{r.tokens_per_s:>12,.0f}{spread:>22}  {r.status}"
        )


def check(device: str) -> bool:
    """Tiny fp32 model on `device`: engine vs transformers, and (CUDA) graph decode vs eager decode."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = build_hf(tiny_config(), torch.float32, device)
    prompts = random_prompts(6, 3, 40, 211, seed=3)
    ok = True
    results = {}
    variants = (
        [(g, k) for g in (False, True) for k in ("triton", "flex", "gather")]
        if device.startswith("cuda")
        else [
            (False, "gather"),
            (False, "flex"),
        ]
    )
    for graphs, kernel in variants:
        engine = Engine(
            model.config,
            EngineConfig(
                dtype=torch.float32,
                device=device,
                max_num_seqs=8,
                max_model_len=128,
                kv_cache_memory_bytes=1 << 22,
                block_size=16,
                max_num_batched_tokens=256,
                use_cuda_graphs=graphs,
                decode_attention=kernel,
                flex_min_batch=1,
            ),
        )
        engine.load_weights(model.state_dict().items())
        results[(graphs, kernel)] = engine.generate(prompts, SamplingParams(n=2, temperature=0.0, max_tokens=24))
        print(f"graphs={graphs} decode={kernel}: {engine.last_stats}")
        if graphs:
            print(f"captured CUDA graphs: {engine.num_cuda_graphs}")
    for index, prompt in enumerate(prompts):
        with torch.no_grad():
            reference = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
            logits = model(torch.tensor([prompt + reference], device=device)).logits[0].double()
        expected_lp = torch.log_softmax(logits, -1)[torch.arange(len(prompt) - 1, len(prompt) + 23), reference]
        for (graphs, kernel), outputs in results.items():
            for completion in outputs[index].samples:
                same = completion.token_ids == reference
                err = (torch.tensor(completion.logprobs, dtype=torch.float64) - expected_lp.cpu()).abs().max().item()
                if not same or err > 1e-4:
                    ok = False
                    print(
                        f"MISMATCH prompt {index} graphs={graphs} decode={kernel}: tokens equal={same}, "
                        f"max |dlogprob|={err:.2e}"
                    )
    print("CHECK PASSED" if ok else "CHECK FAILED")
    return ok


KERNELS_OPTION = typer.Option(
    ["auto"], help="Decode attention kernel(s) to time, one engine each: triton, flex, gather or auto (repeatable)."
)
BLOCK_SIZES_OPTION = typer.Option([32], help="KV-cache block size(s), one engine each (repeatable).")
COMPILE_OPTION = typer.Option(
    ["auto"],
    "--compile",
    help="torch.compile of the pointwise steps and the sampler, one engine each: on, off or auto (on for CUDA) "
    "(repeatable).",
)
COMPILE_MODES = {"auto": None, "on": True, "off": False}


def main(
    tiny: bool = typer.Option(False, help="Tiny model shape (CPU smoke test)."),
    run_check: bool = typer.Option(False, "--check", help="Run the tiny correctness checks instead."),
    device: str = typer.Option("cuda" if torch.cuda.is_available() else "cpu", help="Torch device."),
    num_prompts: int = typer.Option(64, help="Prompts."),
    n: int = typer.Option(8, help="Samples per prompt."),
    max_tokens: int = typer.Option(512, help="New tokens per sample, for every system (EOS ignored)."),
    repeats: int = typer.Option(3, help="Timed runs of each system (the median and the spread are reported)."),
    min_prompt: int = typer.Option(32, help="Shortest prompt."),
    max_prompt: int = typer.Option(128, help="Longest prompt."),
    kv_gib: float = typer.Option(24.0, help="KV-cache budget, GiB."),
    cuda_graphs: bool = typer.Option(True, help="CUDA graphs for the decode step."),
    decode_attention: list[str] = KERNELS_OPTION,
    block_size: list[int] = BLOCK_SIZES_OPTION,
    compile_mode: list[str] = COMPILE_OPTION,
    flex_min_batch: int = typer.Option(64, help="Decode steps of fewer sequences use the gather kernel."),
    hf_generate: bool = typer.Option(True, help="Time transformers generate on the same workload."),
    continuous_batching: str = typer.Option(
        "auto",
        help="Time transformers generate_batch (continuous batching) on the same workload: on, off or auto (on for "
        "CUDA; on CPU its background loop makes a smoke test slow).",
    ),
    json_path: str = typer.Option("", "--json", help="Also write the table's rows to this file."),
) -> None:
    if run_check:
        sys.exit(0 if check(device) else 1)
    unknown = sorted(set(compile_mode) - set(COMPILE_MODES))
    if unknown:
        raise typer.BadParameter(f"--compile must be on, off or auto, got {', '.join(unknown)}")
    if continuous_batching not in COMPILE_MODES:
        raise typer.BadParameter(f"--continuous-batching must be on, off or auto, got {continuous_batching}")
    if repeats < 1:
        raise typer.BadParameter(f"--repeats must be at least 1, got {repeats}")
    if tiny:
        num_prompts, n, max_tokens = min(num_prompts, 4), min(n, 2), min(max_tokens, 16)
        min_prompt, max_prompt, kv_gib = 3, 12, 0.01
    config = tiny_config() if tiny else llama_1b_config()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_hf(config, dtype, device)
    prompts = random_prompts(num_prompts, min_prompt, max_prompt, config.vocab_size, seed=0)
    max_model_len = max_prompt + max_tokens + 16
    print(f"device: {torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}, torch {torch.__version__}")
    rows: list[Row] = []
    engine_rows: list[Row] = []
    decode_steps: list[dict[str, object]] = []

    def save() -> None:
        """The rows so far, then the profiled decode steps (a run stopped early leaves what it measured)."""
        if json_path:
            Path(json_path).write_text(json.dumps([r.record() for r in rows] + decode_steps, indent=1))

    for kernel, size, mode in itertools.product(decode_attention, block_size, compile_mode):
        engine_config = EngineConfig(
            dtype=dtype,
            device=device,
            max_num_seqs=num_prompts * n,
            max_model_len=max_model_len,
            kv_cache_memory_bytes=int(kv_gib * (1 << 30)),
            block_size=size,
            max_num_batched_tokens=max(8192, max_model_len, num_prompts * max_prompt),
            use_cuda_graphs=cuda_graphs,
            decode_attention=kernel,
            flex_min_batch=flex_min_batch,
            torch_compile=COMPILE_MODES[mode],
        )
        label = f"{engine_config.decode_kernel()}, block {size}"
        if len(compile_mode) > 1:
            label += ", compiled" if engine_config.compiled() else ", eager"
        engine = Engine(config, engine_config)
        engine.load_weights(model.state_dict().items())
        timed = [
            dataclasses.replace(r, system=f"{r.system} ({label})")
            for r in time_engine(engine, prompts, n, max_tokens, device, repeats)
        ]
        rows += timed
        engine_rows.append(timed[-1])
        save()
        stats = engine.last_stats
        print(f"[{label}] engine stats: {stats}")
        if stats is not None:
            steps = stats.decode_steps + stats.prefill_steps
            mean_ms = timed[-1].seconds / steps * 1e3
            # the bound of a mean step: every sequence at the workload's mean context
            context = sum(map(len, prompts)) // len(prompts) + max_tokens // 2
            element = torch.empty(0, dtype=dtype).element_size()
            bound_ms = decode_step_bound(config, num_prompts * n, context, element).limit_s * 1e3
            print(
                f"[{label}] engine mean step: {mean_ms:.2f} ms over {steps} steps; H200 bound of a decode step at "
                f"{num_prompts * n} sequences x {context} tokens of context: {bound_ms:.3f} ms "
                f"({bound_ms / mean_ms:.0%})"
            )
        if device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"[{label}] CUDA graphs captured: {engine.num_cuda_graphs}; peak memory {peak:.1f} GiB")
        steps = profile_decode(
            engine,
            config,
            num_prompts * n,
            [min_prompt + 16, (max_prompt + max_tokens) // 2, max_prompt + max_tokens],
            device,
        )
        decode_steps += [{"system": f"decode step ({label})", **step} for step in steps]
        save()
        del engine  # frees its weights, cache and graphs (no reference cycle holds them)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    baselines = []
    if hf_generate:
        baselines.append(time_hf(model, prompts, n, max_tokens, device, repeats))
        rows.append(baselines[-1])
        save()
    if COMPILE_MODES[continuous_batching] or (continuous_batching == "auto" and device.startswith("cuda")):
        baselines.append(time_generate_batch(model, prompts, n, max_tokens, device, repeats))
        rows.append(baselines[-1])
    print_table(rows)
    for engine_row in engine_rows:
        for baseline in baselines:
            if baseline.status == "ok":
                ratio = engine_row.tokens_per_s / baseline.tokens_per_s
                low = engine_row.total_tokens / engine_row.seconds_max / (baseline.total_tokens / baseline.seconds_min)
                high = engine_row.total_tokens / engine_row.seconds_min / (baseline.total_tokens / baseline.seconds_max)
                print(
                    f"{engine_row.system} / {baseline.system} (both batch {baseline.batch}, {max_tokens} new tokens): "
                    f"{ratio:.1f}x (median; {low:.1f}x-{high:.1f}x over the runs)"
                )
    save()


if __name__ == "__main__":
    typer.run(main)
