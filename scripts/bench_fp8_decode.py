"""FP8 GEMMs, the FP8 KV cache and the decode step, each checked on the device and timed beside the current path
and its H200 bound, in one bounded call (issue 21's rollout levers).

Sections, in order (each prints its lines and is saved to `OUT/fp8_decode.json` as it ends; one that fails is
recorded with its error and the run goes on; past `--time-limit` the remaining sections are skipped):
1. `env`: device, torch and CUDA versions; whether the blockwise FP8 GEMM is taken
   (`fp8.scaled_mm_works`) and, where not, why (`fp8.scaled_mm_failure`).
2. `gemm`: the decode step's products at M rows (default 512) of the Llama-3.2-1B shape (qkv, o, gate|up, down,
   the bf16 output layer): bf16 `F.linear` against `fp8_linear` (activation quantization + blockwise
   `scaled_mm`), the GEMM alone and the quantization alone; each FP8 product's relative error against the float32
   product of the dequantized weight. Timed as CUDA-graph replays of 20 calls, 7 replays: median (min-max) per call.
3. `attention`: one layer's decode attention (Triton kernel) at M sequences x each context, bf16 cache against an
   FP8 cache, with every sequence's blocks distinct and with groups of `--n` siblings sharing their first
   `--prompt-tokens` (as the engine's forks share a prompt's full blocks): whether the kernel already gains from
   the shared blocks (L2 hits) tells what in-kernel prompt-block sharing could still save. Checked against SDPA
   over the gathered (dequantized) blocks.
4. `sampler`: one step's sampling of M rows of the vocabulary (bf16 logits, temperature 1): the compiled torch
   sampler (`current`) against the fused Triton kernel (`triton_sampling`), CUDA-graph timed, beside one read of
   the logits at 4.3 TB/s; the share of equal tokens and the largest log-prob difference between the two.
5. `decode_step`: the whole decode step (input copy + CUDA-graph replay, as `bench_engine.py`'s profile) at M
   sequences x each context, for each engine variant (`VARIANTS`: `current`, the path measured on 2026-12-01;
   `bf16`, today's defaults; `fp8-both`, `fp8-weights` (`fp8_weights`), `fp8-kv` (`kv_cache_dtype: fp8`));
   median (min-max) of 5 means of 10 steps. Then one eager step at the middle context under the profiler (kernel
   time by kind, top kernels).
6. `generate`: each variant's `generate` on the GRPO benchmark's workload (`--prompts` x `--n` samples, prompts of
   `--prompt-tokens`, `--new-tokens` new tokens, temperature 1, no stop token): a warm-up, a first run (graph
   capture), then `--repeats` timed runs: tokens/s median (min-max) beside the run's bound (the sum of its decode
   steps' bounds). The log-prob mismatch of the last run's first 64 samples against a bf16 transformers forward
   (`grpo.algorithm.losses.token_mult_prob_error`, the GRPO log's metric; random weights, so near-uniform logits: not a
   real model's figure), and greedy token agreement of each variant with `current` on 16 prompts x 64 tokens. Beside it,
   the last run's mean step and the host's busy time per step (the run less its waits for the device's tokens): where
   the two are close the pipelined loop is bound by the host, not by the decode step.

Bounds (printed beside every time, `roofline.py`'s figures): bytes / 4.3 TB/s and FLOPs / 790 TFLOP/s for bf16
products; FP8 products at twice that rate (`FP8_FLOPS`: the H200's dense FP8 peak is 1979 TFLOP/s, twice bf16's
989); the output layer, norms and embeddings stay bf16.

In the project's environment (on a fresh GPU machine: `TORCH_SPEC= EXTRAS= WHEELS=.whl bash scripts/setup.sh`,
then `. .venv/bin/activate`, as `scripts/gpu_check.sh` does):

    python scripts/bench_fp8_decode.py --out OUT_DIR                 # one H200, about 4-5 minutes
    python scripts/bench_fp8_decode.py --tiny --device cpu --out DIR # CPU smoke run (tiny shape)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_engine import build_hf, llama_1b_config, random_prompts, synthetic_decode_step, tiny_config
from cuda_timing import graph_call_times_us
from profile_summary import profile_call
from roofline import H200_BYTES_PER_S, H200_FLOPS, matmul_weights

from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams, fp8, triton_decode
from hf_mcore_bridge.engine.attention import FP8_CACHE_DTYPE, DecodeMetadata, decode_attention, to_cache
from hf_mcore_bridge.engine.kv_cache import blocks_for
from hf_mcore_bridge.grpo.algorithm.losses import token_mult_prob_error

FP8_FLOPS = 2 * H200_FLOPS
"""FP8 matrix-multiply rate taken for the bound: twice the bf16 rate of `roofline.H200_FLOPS`."""
VARIANTS = {
    "current": {"fused_sampler": False, "fused_rope": False},
    "bf16": {},
    "fp8-both": {"fp8_weights": True, "kv_cache_dtype": "fp8"},
    "fp8-weights": {"fp8_weights": True},
    "fp8-kv": {"kv_cache_dtype": "fp8"},
}
"""Engine variants, in the order they run: `EngineConfig` overrides of the defaults. `current` is the path measured
on 2026-12-01 (bf16, the compiled torch sampler, separate RoPE and cache writes); `bf16` the defaults now (the
fused Triton sampler, the fused RoPE / cache write)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float], unit: float = 1.0, digits: int = 3) -> str:
    return f"{s['median'] * unit:.{digits}f} ({s['min'] * unit:.{digits}f}-{s['max'] * unit:.{digits}f})"


def time_graph_us(fn: Callable[[], object], device: torch.device, calls: int = 20, replays: int = 7) -> dict:
    """Microseconds per call: CUDA-graph replays of `calls` calls, median (min-max) over `replays` (off CUDA: single
    host-timed calls)."""
    return spread(graph_call_times_us(fn, device, calls=calls, replays=replays))


def gemm_bound_us(m: int, n: int, k: int, fp8_weight: bool) -> float:
    """max(bytes / bandwidth, FLOPs / rate): the weight (1 byte per element and its scales in FP8), the bf16 input
    and output."""
    weight = n * k + 4 * math.ceil(n / 128) * math.ceil(k / 128) if fp8_weight else 2 * n * k
    memory = (weight + 2 * m * k + 2 * m * n) / H200_BYTES_PER_S
    return max(memory, 2 * m * n * k / (FP8_FLOPS if fp8_weight else H200_FLOPS)) * 1e6


def step_bound_s(hf_config: Any, rows: int, context: int, fp8_weights: bool, fp8_kv: bool) -> float:
    """The bound of one decode step (`roofline.decode_step_bound`) with FP8 projections (1 byte per weight, twice
    the FLOP rate) and / or an FP8 cache (1 byte per entry); the output layer stays bf16."""
    layers, hidden = hf_config.num_hidden_layers, hf_config.hidden_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    output = hf_config.vocab_size * hidden
    projections = matmul_weights(hf_config) - output
    kv_entries = rows * context * layers * 2 * kv_heads * head_dim
    memory = (projections * (1 if fp8_weights else 2) + 2 * output + kv_entries * (1 if fp8_kv else 2)) / 4.3e12
    compute = 2 * rows * output / H200_FLOPS + 2 * rows * projections / (FP8_FLOPS if fp8_weights else H200_FLOPS)
    compute += 4 * rows * layers * heads * head_dim * context / H200_FLOPS
    return max(memory, compute)


def section_env(device: torch.device) -> dict:
    record: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        record["device"] = torch.cuda.get_device_name(device)
        record["capability"] = list(torch.cuda.get_device_capability(device))
    works = fp8.scaled_mm_works(device)
    record["blockwise_scaled_mm"] = works
    record["scaled_mm_failure"] = fp8.scaled_mm_failure(device)
    print(f"env: {record}")
    print(f"blockwise FP8 scaled_mm taken: {works}" + ("" if works else f" ({record['scaled_mm_failure']})"))
    return record


def section_gemm(device: torch.device, hf_config: Any, rows: int) -> list[dict]:
    hidden, ffn = hf_config.hidden_size, hf_config.intermediate_size
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    shapes = [
        ("qkv_proj", hidden, (heads + 2 * kv_heads) * head_dim),
        ("o_proj", heads * head_dim, hidden),
        ("gate_up_proj", hidden, 2 * ffn),
        ("down_proj", ffn, hidden),
        ("lm_head (bf16 in every variant)", hidden, hf_config.vocab_size),
    ]
    generator = torch.Generator(device=device).manual_seed(0)
    out: list[dict] = []
    header = f"{'GEMM at M=' + str(rows):<36}{'path':<22}{'us median (min-max)':>28}{'bound us':>10}"
    print(f"{header}{'of bound':>10}{'rel err':>9}")
    for name, k, n in shapes:
        x = torch.randn(rows, k, device=device, generator=generator).to(torch.bfloat16)
        w = (torch.randn(n, k, device=device, generator=generator) * 0.02).to(torch.bfloat16)
        cases = _gemm_cases(x, w, fp8_too=not name.startswith("lm_head"))
        for label, fn, fp8_weight, error in cases:
            timing = time_graph_us(fn, device)
            # quantizing x reads 2 bytes and writes 1 per element
            bound = gemm_bound_us(rows, n, k, fp8_weight) if "quantize" not in label else rows * k * 3 / 4.3e6
            row = {"gemm": name, "m": rows, "n": n, "k": k, "path": label.strip(), "us": timing, "bound_us": bound}
            row["relative_error"] = error
            out.append(row)
            err = f"{error:>9.4f}" if error is not None else f"{'':>9}"
            print(
                f"{name:<36}{label:<22}{fmt(timing, digits=1):>28}{bound:>10.1f}{bound / timing['median']:>9.0%} {err}"
            )
    return out


def _gemm_cases(
    x: torch.Tensor, w: torch.Tensor, fp8_too: bool
) -> list[tuple[str, Callable[[], object], bool, float | None]]:
    """(label, call, FP8 weight?, relative error) of each way to compute `x @ w.T`: bf16, and with `fp8_too`
    `fp8_linear`, then (where the blockwise GEMM is taken) the GEMM alone and the activation quantization alone."""
    cases: list[tuple[str, Callable[[], object], bool, float | None]] = [
        ("bf16 F.linear", lambda: F.linear(x, w), False, None)
    ]
    if not fp8_too:
        return cases
    works = fp8.scaled_mm_works(x.device)
    q, scale_inv = fp8.quantize_blockwise(w)
    gemm_scale = fp8.gemm_scales(scale_inv)
    expected = x.float() @ fp8.dequantize_blockwise(q, scale_inv, torch.float32).t()
    got = fp8.fp8_linear(x, q, scale_inv, None, gemm_scale).float()
    error = ((got - expected).norm() / expected.norm()).item()
    label = "fp8_linear" if works else "fp8_linear (dequantize)"
    cases.append((label, lambda: fp8.fp8_linear(x, q, scale_inv, None, gemm_scale), True, error))
    if works:
        xq, x_scale = fp8.quantize_activations(x)
        a_type, b_type = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128

        def gemm() -> torch.Tensor:
            return F.scaled_mm(xq, q.t(), x_scale, a_type, gemm_scale, b_type, output_dtype=torch.bfloat16)

        cases.append(("  scaled_mm alone", gemm, True, None))
        cases.append(("  quantize x alone", lambda: fp8._QUANTIZE(x), True, None))
    return cases


def _tables(batch: int, n_blocks: int, shared_blocks: int, siblings: int, device: torch.device) -> torch.Tensor:
    """Block tables over a cache of `batch * n_blocks + 1` blocks: each row's blocks distinct and scattered, or
    (shared_blocks > 0) each group of `siblings` consecutive rows with the same first `shared_blocks`."""
    generator = torch.Generator().manual_seed(1)
    order = torch.randperm(batch * n_blocks, generator=generator) + 1
    tables = order.view(batch, n_blocks).clone()
    if shared_blocks:
        for start in range(0, batch, siblings):
            tables[start : start + siblings, :shared_blocks] = tables[start, :shared_blocks]
    return tables.to(device)


def section_attention(
    device: torch.device, hf_config: Any, rows: int, contexts: list[int], prompt_tokens: int, siblings: int
) -> list[dict]:
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    block = 32
    out: list[dict] = []
    print(f"{'attention':<44}{'us median (min-max)':>26}{'bound us':>10}{'of bound':>10}{'TB/s':>7}{'max err':>9}")
    for context in contexts:
        n_blocks = blocks_for(context, block)
        torch.manual_seed(0)
        values = torch.randn(2, rows * n_blocks + 1, block, kv_heads, head_dim, device=device, dtype=torch.bfloat16)
        q = torch.randn(rows, heads, head_dim, device=device, dtype=torch.bfloat16)
        lengths = torch.full((rows,), context, dtype=torch.int64, device=device)
        shared = min(prompt_tokens // block, n_blocks - 1)
        for cache_name, cache in (("bf16", values), ("fp8", to_cache(values, FP8_CACHE_DTYPE, 1.0))):
            entry = cache.element_size()
            for sharing in sorted({0, shared}):
                tables = _tables(rows, n_blocks, sharing, siblings, device)
                meta = DecodeMetadata(torch.zeros(rows, dtype=torch.int64, device=device), tables, lengths)
                reference = decode_attention(q, cache, meta, head_dim**-0.5).float()  # gather + SDPA

                call = _triton_call(q, cache, tables, lengths, head_dim**-0.5)
                error = (call().float() - reference).abs().max().item()
                timing = time_graph_us(call, device)
                read = rows * context * kv_heads * head_dim * 2 * entry
                unique = read - (rows - rows // siblings) * sharing * block * kv_heads * head_dim * 2 * entry
                bound = unique / 4.3e6
                label = f"{rows} x {context}, {cache_name} cache, " + (
                    f"{sharing} blocks shared by {siblings}" if sharing else "distinct blocks"
                )
                row = {"case": label, "context": context, "cache": cache_name, "shared_blocks": sharing}
                row |= {"us": timing, "bytes": read, "unique_bytes": unique, "bound_us": bound, "max_error": error}
                out.append(row)
                rate = read / timing["median"] / 1e6
                print(
                    f"{label:<44}{fmt(timing, digits=1):>26}{bound:>10.1f}{bound / timing['median']:>9.0%}"
                    f"{rate:>7.2f}{error:>9.4f}"
                )
                if error > 5e-2:
                    print(f"  MISMATCH: Triton against gathered SDPA, max |error| {error:.3g}")
    return out


def section_sampler(device: torch.device, vocab: int, rows: int) -> dict:
    from hf_mcore_bridge.engine.sampling import Sampler, SamplingBatch

    generator = torch.Generator(device=device).manual_seed(2)
    logits = (torch.randn(rows, vocab, device=device, generator=generator) * 3).to(torch.bfloat16)
    batch = SamplingBatch(
        temperature=torch.ones(rows, device=device),
        top_k=torch.zeros(rows, dtype=torch.int64, device=device),
        top_p=torch.ones(rows, device=device),
        uniforms=torch.rand(rows, dtype=torch.float64, device=device, generator=generator),
        any_random=True,
        any_greedy=False,
        any_truncation=False,
        any_scaled=False,
    )
    torch_sampler, fused_sampler = Sampler(compile=device.type == "cuda"), Sampler(compile=False, fused=True)
    (torch_tokens, torch_lp), (fused_tokens, fused_lp) = torch_sampler(logits, batch), fused_sampler(logits, batch)
    record: dict[str, Any] = {"rows": rows, "vocab": vocab, "bound_us": rows * vocab * 2 / 4.3e6}
    record["equal_tokens"] = (torch_tokens == fused_tokens).float().mean().item()
    record["max_logprob_difference"] = (torch_lp - fused_lp).abs().max().item()
    for name, sampler in (("compiled torch sampler", torch_sampler), ("fused Triton sampler", fused_sampler)):
        timing = time_graph_us(lambda sampler=sampler: sampler(logits, batch), device)
        record[name] = timing
        print(
            f"sampler {rows} x {vocab} bf16, {name:<24}{fmt(timing, digits=1):>26} us   bound "
            f"{record['bound_us']:.1f} us ({record['bound_us'] / timing['median']:.0%})"
        )
    print(
        f"sampler: fused vs torch tokens equal on {record['equal_tokens']:.1%} of rows, log-probs within "
        f"{record['max_logprob_difference']:.2e}"
    )
    return record


def _triton_call(
    q: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, lengths: torch.Tensor, scale: float
) -> Callable[[], torch.Tensor]:
    return lambda: triton_decode.paged_decode_attention(q, cache, tables, lengths, scale)


def _engine(hf_model: Any, device: torch.device, rows: int, max_len: int, kv_gib: float, **overrides: Any) -> Engine:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = EngineConfig(
        dtype=dtype,
        device=str(device),
        max_num_seqs=rows,
        max_model_len=max_len,
        kv_cache_memory_bytes=int(kv_gib * (1 << 30)),
        max_num_batched_tokens=max(8192, max_len, rows * 64),
        **overrides,
    )
    engine = Engine(hf_model.config, config)
    engine.load_weights(hf_model.state_dict().items())
    return engine


def _step_ms(fn: Callable[[], object], device: torch.device, groups: int = 5, calls: int = 10) -> dict:
    for _ in range(3):
        fn()
    means = []
    for _ in range(groups):
        _sync(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        _sync(device)
        means.append((time.perf_counter() - start) / calls * 1e3)
    return spread(means)


def section_decode_step(
    engine: Engine, variant: str, hf_config: Any, rows: int, contexts: list[int], device: torch.device
) -> tuple[list[dict], str]:
    out = []
    overrides = VARIANTS[variant]
    fp8_w, fp8_kv = overrides.get("fp8_weights", False), overrides.get("kv_cache_dtype") == "fp8"
    if fp8_w:
        engine.model.quantize_fp8()  # as `generate` does first
    with torch.inference_mode():
        for context in contexts:
            step = synthetic_decode_step(engine, rows, context)
            timing = _step_ms(lambda step=step: engine._run_decode(step), device)
            bound = step_bound_s(hf_config, rows, context, fp8_w, fp8_kv) * 1e3
            out.append({"variant": variant, "rows": rows, "context": context, "ms": timing, "bound_ms": bound})
            print(
                f"decode step [{variant:<11}] {rows} x {context:<5} {fmt(timing, digits=3):>24} ms   bound "
                f"{bound:.3f} ms ({bound / timing['median']:.0%}; {timing['median'] / bound:.2f}x the bound)"
            )
        middle = contexts[len(contexts) // 2]
        step = synthetic_decode_step(engine, rows, middle)
        summary = "no profile on CPU"
        if device.type == "cuda":
            from hf_mcore_bridge.engine.cuda_graphs import DecodeBatch, pack, unpack

            n_blocks = engine.max_blocks_per_seq
            batch = DecodeBatch(step.input_ids, step.positions, step.slots, step.context_lens, step.block_tables)
            ids, positions, meta = unpack(pack(batch, rows, n_blocks).to(device), rows, n_blocks)
            engine._decode_forward(ids, positions, meta)
            summary = profile_call(lambda: engine._decode_forward(ids, positions, meta), f"{variant} eager step")
            print(summary)
    return out, summary


@contextlib.contextmanager
def _timed_event_waits(total: list[float]) -> Iterator[None]:
    """Adds to `total[0]` the seconds the host spends in `torch.cuda.Event.synchronize` (the engine's wait for a
    decode step's tokens) while the block runs."""
    if not torch.cuda.is_available():
        yield
        return
    original = torch.cuda.Event.synchronize

    def synchronize(event: torch.cuda.Event) -> None:
        start = time.perf_counter()
        original(event)
        total[0] += time.perf_counter() - start

    torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]
    try:
        yield
    finally:
        torch.cuda.Event.synchronize = original  # type: ignore[method-assign]


def _agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Greedy agreement: the fraction of positions equal, and of samples equal throughout."""
    pairs = list(zip(reference, other, strict=True))
    equal = sum(a == b for ref, oth in pairs for a, b in zip(ref, oth, strict=False))
    total = sum(len(ref) for ref, _ in pairs)
    return {"token_agreement": equal / total, "samples_identical": sum(r == o for r, o in pairs) / len(pairs)}


def _mismatch(hf_model: Any, prompts: list[list[int]], outputs: list, n: int, device: torch.device) -> float:
    """`token_mult_prob_error` of the first 64 samples' engine log-probs against a transformers forward."""
    trainer, engine, masks = [], [], []
    samples = [(prompts[i], s) for i, o in enumerate(outputs) for s in o.samples][:64]
    with torch.no_grad():
        for prompt, sample in samples:
            ids = torch.tensor([prompt + sample.token_ids], device=device)
            logits = hf_model(ids).logits[0, len(prompt) - 1 : -1].float()
            logprobs = torch.log_softmax(logits, -1).gather(1, torch.tensor(sample.token_ids, device=device)[:, None])
            trainer.append(logprobs.squeeze(1).cpu())
            engine.append(torch.tensor(sample.logprobs))
            masks.append(torch.ones(len(sample.token_ids)))
    stack = torch.nn.utils.rnn.pad_sequence
    return token_mult_prob_error(stack(trainer, True), stack(engine, True), stack(masks, True)).item()


def section_generate(
    engine: Engine,
    variant: str,
    hf_model: Any,
    args: argparse.Namespace,
    prompts: list[list[int]],
    greedy: dict[str, list[list[int]]],
    device: torch.device,
) -> dict:
    overrides = VARIANTS[variant]
    fp8_w, fp8_kv = overrides.get("fp8_weights", False), overrides.get("kv_cache_dtype") == "fp8"
    rows = len(prompts) * args.n
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.new_tokens, seed=0)
    engine.generate(prompts, SamplingParams(n=args.n, temperature=1.0, max_tokens=8, seed=1))
    engine.generate(prompts, params)  # first run: graphs of the longer contexts
    seconds, outputs = [], []
    waited = [0.0]
    for repeat in range(args.repeats):
        _sync(device)
        start = time.perf_counter()
        if repeat == args.repeats - 1:
            with _timed_event_waits(waited):
                outputs = engine.generate(prompts, params)
        else:
            outputs = engine.generate(prompts, params)
        _sync(device)
        seconds.append(time.perf_counter() - start)
    tokens = sum(len(s.token_ids) for o in outputs for s in o.samples)
    steps = engine.last_stats.decode_steps + engine.last_stats.prefill_steps
    mean_step_ms = seconds[-1] / steps * 1e3
    host_ms = (seconds[-1] - waited[0]) / steps * 1e3
    bound = sum(
        step_bound_s(hf_model.config, rows, args.prompt_tokens + t, fp8_w, fp8_kv) for t in range(1, args.new_tokens)
    )
    rates = spread([tokens / s for s in seconds])
    record = {"variant": variant, "tokens": tokens, "seconds": spread(seconds), "tokens_per_s": rates}
    record |= {"bound_s": bound, "bound_tokens_per_s": tokens / bound, "stats": vars(engine.last_stats)}
    record |= {"mean_step_ms": mean_step_ms, "host_busy_ms_per_step": host_ms}
    record["token_mult_prob_error"] = _mismatch(hf_model, prompts, outputs, args.n, device)
    few = prompts[:16]
    greedy[variant] = [
        o.samples[0].token_ids
        for o in engine.generate(few, SamplingParams(n=1, temperature=0.0, max_tokens=min(64, args.new_tokens)))
    ]
    if variant != "current" and "current" in greedy:
        record |= _agreement(greedy["current"], greedy[variant])
    agreement = (
        f", greedy agreement with current {record['token_agreement']:.3f} "
        f"({record['samples_identical']:.0%} of samples identical)"
        if "token_agreement" in record
        else ""
    )
    print(
        f"generate [{variant:<11}] {tokens} tokens: {fmt(rates, digits=0)} tokens/s, {fmt(record['seconds'])} s; "
        f"bound {bound:.3f} s ({tokens / bound:,.0f} tokens/s; measured {record['seconds']['median'] / bound:.2f}x "
        f"the bound); token_mult_prob_error {record['token_mult_prob_error']:.4f}{agreement}"
    )
    print(
        f"generate [{variant:<11}] last run: mean step {mean_step_ms:.3f} ms over {steps} steps, of which the host "
        f"was busy {host_ms:.3f} ms (not waiting for the device's tokens): near the mean step, the loop is host-bound"
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="Directory for fp8_decode.json.")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="Tiny shape and workload (CPU smoke run).")
    parser.add_argument("--rows", type=int, default=512, help="Decoding sequences (GEMM rows).")
    parser.add_argument("--contexts", type=int, nargs="+", default=[64, 320, 576])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8, help="Samples per prompt.")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=12.0, help="KV-cache budget of each engine, GiB.")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--time-limit", type=float, default=300.0, help="Seconds; later sections are skipped.")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        args.rows, args.contexts, args.prompts, args.n = 16, [8, 24], 4, 4
        args.prompt_tokens, args.new_tokens, args.repeats, args.kv_gib = 8, 16, 2, 0.02
    hf_config = tiny_config() if args.tiny else llama_1b_config()
    if args.tiny:  # 128-wide projections, so the FP8 path has whole blocks
        hf_config.hidden_size, hf_config.intermediate_size, hf_config.head_dim = 128, 256, 32
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def save() -> None:
        (args.out / "fp8_decode.json").write_text(json.dumps(results, indent=1, default=str))

    def run(name: str, fn: Callable[[], Any]) -> Any:
        if time.perf_counter() - began > args.time_limit:
            results[name] = "skipped: time limit"
            print(f"{name}: skipped (past --time-limit {args.time_limit:.0f} s)")
            save()
            return None
        try:
            results[name] = fn()
        except Exception as err:  # one section's failure is recorded; the others still run
            traceback.print_exc()
            results[name] = f"error: {type(err).__name__}: {err}"
            print(f"{name}: FAILED: {type(err).__name__}: {err}")
        save()
        print(f"[{name} done at {time.perf_counter() - began:.0f} s]", flush=True)
        return results[name]

    run("env", lambda: section_env(device))
    run("gemm", lambda: section_gemm(device, hf_config, args.rows))
    run(
        "attention",
        lambda: (
            section_attention(device, hf_config, args.rows, args.contexts, args.prompt_tokens, args.n)
            if device.type == "cuda" or triton_decode.interpreted()
            else "skipped: the Triton kernel runs on CPU only in its interpreter (TRITON_INTERPRET=1)"
        ),
    )
    run(
        "sampler",
        lambda: (
            section_sampler(device, hf_config.vocab_size, args.rows)
            if device.type == "cuda" or triton_decode.interpreted()
            else "skipped: the Triton kernel runs on CPU only in its interpreter (TRITON_INTERPRET=1)"
        ),
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hf_model = build_hf(hf_config, dtype, str(device))
    prompts = random_prompts(args.prompts, args.prompt_tokens, args.prompt_tokens, hf_config.vocab_size, seed=0)
    max_len = max(args.prompt_tokens + args.new_tokens, max(args.contexts)) + 16
    greedy: dict[str, list[list[int]]] = {}
    for variant in args.variants:
        built = run(
            f"engine {variant}",
            lambda v=variant: _engine(hf_model, device, args.prompts * args.n, max_len, args.kv_gib, **VARIANTS[v]),
        )
        if not isinstance(built, Engine):
            continue
        results[f"engine {variant}"] = "built"
        run(
            f"decode_step {variant}",
            lambda e=built, v=variant: section_decode_step(e, v, hf_config, args.rows, args.contexts, device),
        )
        run(
            f"generate {variant}",
            lambda e=built, v=variant: section_generate(e, v, hf_model, args, prompts, greedy, device),
        )
        del built
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"bench_fp8_decode: done in {time.perf_counter() - began:.0f} s; {args.out / 'fp8_decode.json'}")


if __name__ == "__main__":
    main()
