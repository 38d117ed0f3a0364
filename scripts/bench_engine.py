"""Throughput of the embedded engine against transformers `generate`, on the same model, GPU and run.

Default shape: Llama-3.2-1B (hidden 2048, 16 layers, 32 heads, 8 KV heads, FFN 8192, vocab 128256, tied
embeddings, llama3 RoPE scaling), random bf16 weights, 64 prompts x 8 samples, 512 new tokens each, EOS ignored.
transformers is timed on fewer new tokens (`--hf-tokens`, 64 by default, to keep the run short) and reported as
tokens/s, both on the same 64 x 8 workload (`num_return_sequences=8`) and at batch 64 (one sample per prompt).

    PYTHONPATH=. python3 scripts/bench_engine.py            # the full benchmark (CUDA)
    PYTHONPATH=. python3 scripts/bench_engine.py --check    # tiny fp32 correctness checks on the device
    python scripts/bench_engine.py --tiny --device cpu      # the whole benchmark on a tiny shape (CPU smoke test)

`--check` compares the engine's greedy tokens with transformers `generate` and its log-probs with a transformers
forward pass, and on CUDA compares CUDA-graph decode with eager decode; it exits non-zero on a mismatch.

`--decode-attention triton --decode-attention flex` (and `--block-size 16 --block-size 32`) time one engine per
kernel and block size in the same run, each against the same `generate` rows.

`--compile on --compile off` times the engine with and without its `torch.compile`d pointwise steps and sampler.

Measured on one H200 (torch 2.11, transformers 5.17), default arguments (the Triton decode kernel over 32-token
blocks, pipelined steps, compiled pointwise steps and sampler): engine 120,885-121,841 tokens/s over three runs
(FlexAttention 108,456 in the same run as the 121,841); transformers generate on the same 64 x 8 workload
4,461-6,139 tokens/s, i.e. 19.8x to 27.1x (6,139 was timed on all 512 new tokens), and 821 tokens/s at batch 64
(147x). A decode step at 512 sequences takes 2.68 ms at 48 tokens of context and 5.00 ms at 640; compiled
sampling 0.25 ms (1.57 ms eager).
Figures and what limits them: `docs/PERFORMANCE.md`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import typer
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

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
    system: str
    batch: int
    new_tokens: int
    total_tokens: int
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.total_tokens / self.seconds


def time_engine(engine: Engine, prompts: list[list[int]], n: int, max_tokens: int, device: str) -> list[Row]:
    """Two timed runs after a short warm-up: the first also captures the CUDA graphs of longer contexts, the
    second is the steady state of an engine reused across generate calls (as in RL)."""
    engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=8, seed=1))
    rows = []
    for name in ("engine, first run", "engine"):
        sync(device)
        start = time.perf_counter()
        outputs = engine.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, seed=0))
        sync(device)
        seconds = time.perf_counter() - start
        total = sum(len(s.token_ids) for o in outputs for s in o.samples)
        rows.append(Row(name, len(prompts) * n, max_tokens, total, seconds))
    return rows


def time_hf(model: PreTrainedModel, prompts: list[list[int]], n: int, new_tokens: int, device: str) -> Row:
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    ids, mask = ids.to(device), mask.to(device)

    def run(tokens: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(
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

    run(2)  # warm-up
    sync(device)
    start = time.perf_counter()
    out = run(new_tokens)
    sync(device)
    seconds = time.perf_counter() - start
    generated = out.shape[1] - width
    return Row("transformers generate", len(prompts) * n, generated, len(prompts) * n * generated, seconds)


def profile_decode(engine: Engine, rows: int, contexts: list[int], device: str) -> None:
    """Milliseconds of one decode step (input copy + model, graph replay on CUDA) and of sampling, at `rows`
    sequences of each context length; the difference to the engine's mean step time is host-side work."""
    block_size = engine.config.block_size
    header = (
        f"{'context':>8}{'decode ms':>11}{'eager sample ms':>17}{'engine sampler ms':>19}"
        f"{'flat-cdf draw ms':>18}{'2-level draw ms':>17}"
    )
    print(f"{header}   (rows={rows})")
    for context in contexts:
        n_blocks = blocks_for(context, block_size)
        tables = (torch.arange(rows * n_blocks, dtype=torch.int32).view(rows, n_blocks) % (engine.num_blocks - 1)) + 1
        last = (context - 1) % block_size
        step = DecodeStep(
            sequences=[],
            input_ids=[1] * rows,
            positions=[context - 1] * rows,
            slots=[int(b) * block_size + last for b in tables[:, -1]],
            context_lens=[context] * rows,
            block_tables=tables,
            copies=[],
        )
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
        print(f"{context:>8}{decode_ms:>11.2f}{sample_ms:>17.2f}{sampler_ms:>19.2f}{draws[0]:>18.2f}{draws[1]:>17.2f}")


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
    print(f"{'system':<40}{'batch':>7}{'new tok/seq':>13}{'tokens':>10}{'seconds':>10}{'tokens/s':>12}")
    for r in rows:
        print(
            f"{r.system:<40}{r.batch:>7}{r.new_tokens:>13}{r.total_tokens:>10}{r.seconds:>10.2f}{r.tokens_per_s:>12.0f}"
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
    max_tokens: int = typer.Option(512, help="New tokens per sample for the engine (EOS ignored)."),
    hf_tokens: int = typer.Option(64, help="New tokens per sample for transformers generate."),
    min_prompt: int = typer.Option(32, help="Shortest prompt."),
    max_prompt: int = typer.Option(128, help="Longest prompt."),
    kv_gib: float = typer.Option(24.0, help="KV-cache budget, GiB."),
    cuda_graphs: bool = typer.Option(True, help="CUDA graphs for the decode step."),
    decode_attention: list[str] = KERNELS_OPTION,
    block_size: list[int] = BLOCK_SIZES_OPTION,
    compile_mode: list[str] = COMPILE_OPTION,
    flex_min_batch: int = typer.Option(64, help="Decode steps of fewer sequences use the gather kernel."),
    skip_hf_batch64: bool = typer.Option(False, help="Skip the transformers batch-64 measurement."),
    json_path: str = typer.Option("", "--json", help="Also write the table's rows to this file."),
) -> None:
    if run_check:
        sys.exit(0 if check(device) else 1)
    unknown = sorted(set(compile_mode) - set(COMPILE_MODES))
    if unknown:
        raise typer.BadParameter(f"--compile must be on, off or auto, got {', '.join(unknown)}")
    if tiny:
        num_prompts, n, max_tokens, hf_tokens = min(num_prompts, 4), min(n, 2), min(max_tokens, 16), 8
        min_prompt, max_prompt, kv_gib = 3, 12, 0.01
    config = tiny_config() if tiny else llama_1b_config()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model = build_hf(config, dtype, device)
    prompts = random_prompts(num_prompts, min_prompt, max_prompt, config.vocab_size, seed=0)
    max_model_len = max_prompt + max_tokens + 16
    print(f"device: {torch.cuda.get_device_name() if device.startswith('cuda') else 'cpu'}, torch {torch.__version__}")
    rows: list[Row] = []
    engine_rows: list[Row] = []
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
            for r in time_engine(engine, prompts, n, max_tokens, device)
        ]
        rows += timed
        engine_rows.append(timed[-1])
        stats = engine.last_stats
        print(f"[{label}] engine stats: {stats}")
        if stats is not None:
            mean_ms = timed[-1].seconds / (stats.decode_steps + stats.prefill_steps) * 1e3
            print(f"[{label}] engine mean step: {mean_ms:.2f} ms")
        if device.startswith("cuda"):
            peak = torch.cuda.max_memory_allocated() / 2**30
            print(f"[{label}] CUDA graphs captured: {engine.num_cuda_graphs}; peak memory {peak:.1f} GiB")
        profile_decode(
            engine,
            num_prompts * n,
            [min_prompt + 16, (max_prompt + max_tokens) // 2, max_prompt + max_tokens],
            device,
        )
        del engine  # frees its weights, cache and graphs (no reference cycle holds them)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
    hf_rows = [time_hf(model, prompts, n, hf_tokens, device)]
    if not skip_hf_batch64:
        hf_rows.append(time_hf(model, prompts, 1, hf_tokens, device))
    rows += hf_rows
    print_table(rows)
    for engine_row in engine_rows:
        for hf in hf_rows:
            ratio = engine_row.tokens_per_s / hf.tokens_per_s
            print(f"{engine_row.system} / transformers (batch {hf.batch}): {ratio:.1f}x")
    if json_path:
        Path(json_path).write_text(json.dumps([dataclasses.asdict(r) | {"tokens_per_s": r.tokens_per_s} for r in rows]))


if __name__ == "__main__":
    typer.run(main)
