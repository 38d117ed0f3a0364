"""A mixture-of-experts model's rollouts on one GPU: the engine alone, generation timed against its memory bound.

The engine is built for a published MoE shape at `--layers` of its depth (the first N layers, dense ones included),
its random bf16 weights drawn on the device tensor by tensor, layer by layer, straight into the engine through
`load_weights` (no host copy, no checkpoint), and then generates one engine replica's share of a GRPO recipe's
step: `--prompts` (8) prompts of `--prompt-tokens` (256) random tokens x `--n` (8) samples = 64 sequences, each to
exactly `--max-new-tokens` (4096) new tokens (no stop token), temperature 1. Printed (and written to `--json`):

- the run: its wall time, the prefill alone (a run of one new token), and the mean decode step: (wall - prefill) /
  decode steps;
- the memory bound of that mean step at 4.3 TB/s (`roofline.H200_BYTES_PER_S`): the bytes one decode step must
  read: every dense weight (attention, dense and shared-expert MLPs, routers, norms, the output layer; not the
  embedding table, of which a step reads a few rows), the routed experts the batch touches (per MoE layer the
  distinct experts of its decode steps, counted in an eager pass over the first `--count-steps` steps of the same
  batch), and the KV cache of every sequence at the run's mean context (prompt + new / 2; the read grows linearly,
  so the mean step's bound is the run's mean); and the measured step over that bound (the goal: within 2x);
- decode steps of the same batch at three contexts (random tokens over the cache the run left, CUDA-graph replay
  on CUDA), each beside its own bound with the distinct experts it touched;
- `--sweep-tiles`: one MoE layer's routed experts alone at the batch's rows, for each expert kernel (the Triton one
  with either sort by expert) and a few Triton tiles, beside the bound of the experts they touch (to choose
  `fused_moe`'s default tiles), and each sort by expert alone (`expert_sort`: torch ops, or one Triton kernel).

`--moe-sort` picks the fast MoE kernels' sort by expert (`EngineConfig.moe_sort`): `auto` (the engine's default: one
Triton kernel a layer on CUDA), `triton`, or `torch` (about fifteen small torch kernels a layer, to compare).

Shapes (each from its published config.json; `--layers` below the full depth where the model does not fit):
- `qwen3-30b-a3b` (default `--layers` 48, all): Qwen3-30B-A3B, 128 experts of width 768, top-8; 61 GB in bf16.
- `glm4.5-air` (default 16 of 46): a dense first layer, then 128 experts of width 1408 and a shared expert, top-8.
- `deepseek-v3` (default 5 of 61: 3 dense, 2 MoE): multi-latent attention, 256 experts of width 2048 and a shared
  expert, top-8 within 4 of 8 groups. Its latent attention decodes through the Triton latent kernel
  (`engine.triton_mla`; `--decode-attention gather`: torch over the gathered latent blocks, as before it).

On the GPU machine, in the project's environment (`TORCH_SPEC= EXTRAS= bash scripts/setup.sh; . .venv/bin/activate`):

    python scripts/bench_moe_generation.py qwen3-30b-a3b --json OUT/moe_qwen3.json
    python scripts/bench_moe_generation.py glm4.5-air --json OUT/moe_glm.json
    python scripts/bench_moe_generation.py deepseek-v3 --json OUT/moe_ds.json
    python scripts/bench_moe_generation.py qwen3-30b-a3b --layers 4 --max-new-tokens 256 --sweep-tiles
    python scripts/bench_moe_generation.py qwen3-30b-a3b --moe-sort torch --json OUT/moe_qwen3_torch_sort.json

`--tiny --device cpu` runs the same plumbing on the architecture's tiny test shape (a smoke test; its figures mean
nothing). A shape that does not fit the device is refused before anything is allocated.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from random_checkpoint import SHAPES
from roofline import H200_BYTES_PER_S

from hf_mcore_bridge.engine import Engine, EngineConfig, SamplingParams, read_spec
from hf_mcore_bridge.engine.expert_sort import sort_experts
from hf_mcore_bridge.engine.fused_moe import (
    SILU,
    Tiles,
    fused_experts,
    grouped_gemm,
    grouped_mm_experts,
)
from hf_mcore_bridge.engine.kv_cache import blocks_for
from hf_mcore_bridge.engine.model import CausalLM, Experts, SparseMoe, route, routed_experts
from hf_mcore_bridge.engine.options import DECODE_KERNELS, MOE_KERNELS, MOE_SORTS
from hf_mcore_bridge.engine.scheduler import DecodeStep
from hf_mcore_bridge.models.tiny_models import tiny_config

MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "qwen3-30b-a3b": (SHAPES["qwen3-30b-a3b"], 48),
    "glm4.5-air": ({**SHAPES["glm4.5-air"], "num_hidden_layers": 46}, 16),
    "deepseek-v3": (
        {**SHAPES["deepseek-v3"], "num_hidden_layers": 61, "n_routed_experts": 256, "first_k_dense_replace": 3},
        5,
    ),
}
"""Shape name -> (its full-depth HF config, the default `--layers` on one H200)."""
TINY_LAYERS = 3
SWEEP_TILES = tuple(
    Tiles(16, block_n, block_k, warps, stages)
    for block_n, block_k in ((32, 128), (32, 256), (64, 64), (64, 128), (64, 256), (128, 64), (128, 128))
    for warps in (4, 8)
    for stages in (3, 4, 5)
)
"""Triton tiles timed by `--sweep-tiles`, for each of the two products alone (block_m 16: the decode batch gives
each expert a few rows)."""


class OneLineParser(argparse.ArgumentParser):
    """Bad arguments: one line on stderr, exit status 2."""

    def error(self, message: str) -> NoReturn:
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--layers", type=int, help="the first N layers of the model (default: the shape's)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=8, help="samples a prompt")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=4096)
    parser.add_argument("--moe-kernel", default="auto", choices=("auto", *MOE_KERNELS))
    parser.add_argument(
        "--moe-sort", default="auto", choices=("auto", *MOE_SORTS), help="the fast kernels' sort by expert"
    )
    parser.add_argument("--decode-attention", default="auto", choices=("auto", *DECODE_KERNELS))
    parser.add_argument("--tiles", help="the Triton kernel's tile: block_m,block_n,block_k,warps,stages")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--count-steps", type=int, default=16, help="eager decode steps counting touched experts")
    parser.add_argument("--sweep-tiles", action="store_true", help="time one MoE layer per kernel and tile")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="the architecture's tiny test shape (smoke test)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    for name in ("prompts", "n", "prompt_tokens", "max_new_tokens", "count_steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    full = TINY_LAYERS if args.tiny else MODELS[args.model][0]["num_hidden_layers"]
    if args.layers is not None and not 1 <= args.layers <= full:
        parser.error(f"--layers must be between 1 and the model's {full} layers, got {args.layers}")
    if args.tiles is not None:
        try:
            args.tiles = Tiles(*(int(v) for v in args.tiles.split(",")))
        except (TypeError, ValueError) as err:
            parser.error(f"--tiles {args.tiles!r}: {err}")
    return args


def hf_config(args: argparse.Namespace) -> dict[str, Any]:
    """The model's HF config at `--layers` (a tiny one of the same architecture with `--tiny`)."""
    full, default_layers = MODELS[args.model]
    if args.tiny:
        config = tiny_config(full["architectures"][0], num_hidden_layers=TINY_LAYERS)
        layers = args.layers or TINY_LAYERS
    else:
        config = dict(full)
        layers = args.layers or default_layers
    return {**config, "num_hidden_layers": layers}


@dataclass(frozen=True)
class Sizes:
    """Bytes the bound counts, from the engine's own parameters."""

    dense_bytes: int
    """Every weight but the routed experts and an untied embedding table."""
    expert_bytes: int
    """One routed expert's gate/up and down projections (every MoE layer's experts are the same size)."""
    experts_per_layer: int
    moe_layers: int
    kv_bytes_per_token: int
    weight_bytes: int
    """Everything the engine holds as weights."""


def model_sizes(model: CausalLM, kv_bytes_per_token: int) -> Sizes:
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    routed = {id(p) for m in experts for p in m.parameters()}
    params = list(model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    dense = sum(p.numel() * p.element_size() for p in params if id(p) not in routed)
    if not model.cfg.tie_word_embeddings:
        embedding = model.model.embed_tokens.weight
        dense -= embedding.numel() * embedding.element_size()
    first = experts[0]
    per_expert = (first.gate_up_proj[0].numel() + first.down_proj[0].numel()) * first.gate_up_proj.element_size()
    return Sizes(dense, per_expert, first.gate_up_proj.shape[0], len(experts), kv_bytes_per_token, weight_bytes)


def step_bound_s(sizes: Sizes, rows: int, context: float, experts_touched: float) -> float:
    """Seconds one decode step needs to read its bytes at 4.3 TB/s: dense weights, `experts_touched` routed experts
    in all (summed over the MoE layers) and `rows` sequences' KV cache at `context` tokens."""
    kv = rows * context * sizes.kv_bytes_per_token
    return (sizes.dense_bytes + experts_touched * sizes.expert_bytes + kv) / H200_BYTES_PER_S


def random_weights(model: CausalLM, device: torch.device, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) for every weight the engine expects, drawn on `device` layer by layer: norms 1, biases and
    the router's score bias 0, every matrix N(0, 0.02)."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def layer_of(name: str) -> int:
        parts = name.split(".")
        return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1

    for name in sorted(model.targets, key=lambda n: (layer_of(n), n)):
        view = model.hf_view(name)
        tensor = torch.empty(view.shape, dtype=view.dtype, device=device)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        elif name.endswith("bias"):
            tensor.zero_()
        else:
            tensor.normal_(0.0, 0.02, generator=generator)
        yield name, tensor


def random_prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=generator).tolist() for _ in range(count)]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - start


class ExpertCounter:
    """Forward hooks on every `Experts` module that record, for passes of `rows` tokens (decode steps), the distinct
    experts each MoE layer's batch routes to; they run in eager passes only (a graph replay calls no hook)."""

    def __init__(self, model: CausalLM, rows: int) -> None:
        self.rows = rows
        self.counts: list[list[int]] = [[] for m in model.modules() if isinstance(m, Experts)]
        experts = [m for m in model.modules() if isinstance(m, Experts)]
        self.handles = [m.register_forward_pre_hook(self._hook(i)) for i, m in enumerate(experts)]

    def _hook(self, layer: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            if args[0].shape[0] == self.rows:
                self.counts[layer].append(int(args[2].unique().numel()))

        return hook

    def touched(self) -> float:
        """Distinct experts a decode step touches, summed over the MoE layers (mean over the steps counted)."""
        return sum(statistics.mean(c) for c in self.counts if c)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def eager(engine: Engine, fn: Callable[[], Any]) -> Any:
    """`fn()` with the engine's decode graphs set aside (every decode step eager, so hooks run)."""
    graphs, engine._graphs = engine._graphs, None
    try:
        return fn()
    finally:
        engine._graphs = graphs


def decode_step(engine: Engine, rows: int, context: int, seed: int) -> DecodeStep:
    """A decode step of `rows` sequences at `context` tokens over the cache's blocks 1.. (random input tokens)."""
    block_size = engine.config.block_size
    n_blocks = blocks_for(context, block_size)
    tables = torch.arange(rows * n_blocks, dtype=torch.int32).view(rows, n_blocks) % (engine.num_blocks - 1) + 1
    last = (context - 1) % block_size
    ids = torch.randint(0, engine.model_config.vocab_size, (rows,), generator=torch.Generator().manual_seed(seed))
    return DecodeStep(
        sequences=[],
        input_ids=ids.tolist(),
        positions=[context - 1] * rows,
        slots=[int(b) * block_size + last for b in tables[:, -1]],
        context_lens=[context] * rows,
        block_tables=tables,
        copies=[],
    )


def time_ms(fn: Callable[[], Any], device: torch.device, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    _, seconds = timed(lambda: [fn() for _ in range(repeats)], device)
    return seconds / repeats * 1e3


def profile_steps(engine: Engine, sizes: Sizes, rows: int, contexts: list[int]) -> list[dict[str, float]]:
    """Each context's decode step: its time (graph replay where the engine has graphs) and its bound with the
    experts it touched (counted in one eager pass of the same step)."""
    records = []
    print(f"{'context':>8}{'decode ms':>11}{'bound ms':>11}{'x bound':>10}{'experts a layer':>18}  (rows={rows})")
    for context in contexts:
        step = decode_step(engine, rows, context, seed=context)
        counter = ExpertCounter(engine.model, rows)
        with torch.inference_mode():
            eager(engine, lambda step=step: engine._run_decode(step))
            counter.remove()
            decode_ms = time_ms(lambda step=step: engine._run_decode(step), engine.device)
        touched = counter.touched()
        bound_ms = step_bound_s(sizes, rows, context, touched) * 1e3
        print(
            f"{context:>8}{decode_ms:>11.2f}{bound_ms:>11.3f}{decode_ms / bound_ms:>9.2f}x"
            f"{touched / sizes.moe_layers:>11.1f} of {sizes.experts_per_layer}"
        )
        records.append({"context": context, "decode_ms": decode_ms, "bound_ms": bound_ms, "experts_touched": touched})
    return records


def sweep_tiles(engine: Engine, sizes: Sizes, rows: int) -> dict[str, Any]:
    """One MoE layer's routed experts at `rows` tokens (hidden states random, routed by the layer's own router):
    the whole layer per expert kernel (default tiles; the Triton one with each sort by expert), then, on CUDA,
    each sort alone (`MOE_SORTS`) and each Triton product alone per tile of `SWEEP_TILES`, each beside the bound
    of the experts they touch; the best tile of each product, and the layer with both best tiles."""
    layer = next(m for m in engine.model.modules() if isinstance(m, SparseMoe))
    experts = layer.experts
    moe = layer.moe
    x = torch.randn(rows, experts.gate_up_proj.shape[2], device=engine.device).to(experts.gate_up_proj.dtype)
    weights, chosen = route(layer.gate(x), moe.topk, moe.renormalize, score_function=moe.score_function)
    touched = int(chosen.unique().numel())
    bound_ms = touched * sizes.expert_bytes / H200_BYTES_PER_S * 1e3
    args = (x, experts.gate_up_proj, experts.down_proj, weights, chosen)
    runs: dict[str, Callable[[], Any]] = {"exact": lambda: routed_experts(*args)}
    if engine.device.type == "cuda" and x.dtype == torch.bfloat16:
        runs["grouped_mm"] = lambda: grouped_mm_experts(*args)
    if engine.device.type == "cuda":
        for method in MOE_SORTS:
            runs[f"triton, default tiles, {method} sort"] = lambda m=method: fused_experts(*args, sort=m)
    print(
        f"one MoE layer's experts at {rows} rows: {touched} of {sizes.experts_per_layer} touched, "
        f"bound {bound_ms:.3f} ms"
    )
    layer_records = [_timed_record(name, run, bound_ms, engine.device) for name, run in runs.items()]
    record: dict[str, Any] = {"touched": touched, "bound_ms": bound_ms, "layer": [r for r in layer_records if r]}
    if engine.device.type != "cuda":
        return record
    gate_up, down = experts.gate_up_proj, experts.down_proj
    width, hidden, top_k = down.shape[2], x.shape[1], chosen.shape[1]
    order = sort_experts(chosen, gate_up.shape[0], 16)
    sorts = {
        method: _timed_record(
            f"sort by expert ({method})",
            lambda m=method: sort_experts(chosen, gate_up.shape[0], 16, m),
            None,
            engine.device,
        )
        for method in MOE_SORTS
    }
    act = torch.empty(rows * top_k, width, dtype=x.dtype, device=x.device)
    out = torch.empty(rows * top_k, hidden, dtype=x.dtype, device=x.device)
    flat = weights.flatten()
    products: dict[str, tuple[float, Callable[[Tiles], Any]]] = {
        "gate_up": (
            bound_ms * 2 / 3,
            lambda t: grouped_gemm(x, gate_up, None, act, None, order, t, top_k, width, hidden, SILU),
        ),
        "down": (bound_ms / 3, lambda t: grouped_gemm(act, down, None, out, flat, order, t, 1, hidden, width, SILU)),
    }
    best: dict[str, Tiles] = {}
    for product, (product_bound, launch) in products.items():
        print(f"  {product} alone, bound {product_bound:.3f} ms:")
        timings = []
        for tiles in SWEEP_TILES:
            timed_record = _timed_record(
                f"    {asdict(tiles)}", lambda t=tiles, go=launch: go(t), product_bound, engine.device
            )
            if timed_record:
                timings.append((timed_record["ms"], tiles, timed_record))
        best[product] = min(timings, key=lambda t: t[0])[1]
        record[product] = [t[2] for t in timings]
        print(f"  best {product}: {asdict(best[product])}")
    both = _timed_record(
        "layer, both best tiles",
        lambda: fused_experts(*args, tiles=best["gate_up"], down_tiles=best["down"]),
        bound_ms,
        engine.device,
    )
    return record | {"sort": sorts, "best": {k: asdict(v) for k, v in best.items()}, "layer_best": both}


def _timed_record(
    name: str, run: Callable[[], Any], bound_ms: float | None, device: torch.device
) -> dict[str, Any] | None:
    """`run` timed (`time_ms`) and printed beside `bound_ms`; None where it fails (a tile Triton cannot compile
    here: reported, the sweep goes on)."""
    try:
        with torch.inference_mode():
            ms = time_ms(run, device)
    except Exception as err:
        print(f"  {name}: error: {type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}")
        return None
    ratio = f"{ms / bound_ms:>8.2f}x bound" if bound_ms else ""
    print(f"  {name:<90}{ms:>9.3f} ms {ratio}")
    return {"kernel": name.strip(), "ms": ms, "bound_ms": bound_ms}


def fits(config: dict[str, Any], engine_config: EngineConfig, device: torch.device) -> None:
    """Exit 2 with one line where the weights and the KV cache exceed the device's free memory (counted on meta
    tensors, before anything is allocated)."""
    if device.type != "cuda":
        return
    spec = read_spec(config)
    model = CausalLM(spec, engine_config.dtype, "meta", 1)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    free, _ = torch.cuda.mem_get_info(device)
    need = weights + engine_config.kv_cache_memory_bytes
    if need > 0.95 * free:
        print(
            f"error: {config['num_hidden_layers']} layers need {weights / 1e9:.1f} GB of weights and "
            f"{engine_config.kv_cache_memory_bytes / 1e9:.1f} GB of KV cache; the device has {free / 1e9:.1f} GB "
            "free: use --layers",
            file=sys.stderr,
        )
        sys.exit(2)


def build_engine(args: argparse.Namespace, config: dict[str, Any]) -> Engine:
    device = torch.device(args.device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    samples = args.prompts * args.n
    max_model_len = args.prompt_tokens + args.max_new_tokens
    spec = read_spec(config)
    planes, heads, width = CausalLM(spec, dtype, "meta", 1).cache_entry
    block_size = 32 if device.type == "cuda" else 4
    block_bytes = block_size * spec.num_layers * planes * heads * width * torch.empty((), dtype=dtype).element_size()
    engine_config = EngineConfig(
        dtype=dtype,
        device=args.device,
        max_num_seqs=samples,
        max_model_len=max_model_len,
        kv_cache_memory_bytes=(samples * blocks_for(max_model_len, block_size) + 2) * block_bytes,
        block_size=block_size,
        max_num_batched_tokens=max(8192, max_model_len, args.prompts * args.prompt_tokens),
        use_cuda_graphs=not args.no_cuda_graphs,
        moe_kernel=args.moe_kernel,
        moe_sort=args.moe_sort,
        decode_attention=args.decode_attention,
    )
    fits(config, engine_config, device)
    engine = Engine(config, engine_config)
    if args.tiles is not None:
        for module in engine.model.modules():
            if isinstance(module, Experts):
                module.tiles = args.tiles
    return engine


def count_touched(engine: Engine, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Distinct experts a decode step of the batch touches, summed over the MoE layers: the mean over the first
    `--count-steps` decode steps of the same prompts, run eagerly with `ExpertCounter`'s hooks."""
    counter = ExpertCounter(engine.model, args.prompts * args.n)
    short = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.count_steps + 1, seed=1)
    try:
        with torch.inference_mode():
            eager(engine, lambda: engine.generate(prompts, short))
    finally:
        counter.remove()
    return counter.touched()


def capture_graphs(engine: Engine, args: argparse.Namespace) -> float:
    """Seconds to capture the decode graph of every context bucket the run will reach (0 without graphs), so that
    the timed run replays only."""
    if engine._graphs is None:
        return 0.0
    step_tokens = engine.config.block_size * engine.config.graph_block_step
    last = engine.config.max_model_len
    contexts = range(args.prompt_tokens + 1, last + step_tokens, step_tokens)
    steps = [decode_step(engine, args.prompts * args.n, min(c, last), 0) for c in contexts]
    with torch.inference_mode():
        _, seconds = timed(lambda: [engine._run_decode(step) for step in steps], engine.device)
    print(f"captured {engine.num_cuda_graphs} decode CUDA graphs in {seconds:.1f} s")
    return seconds


def run_generation(
    engine: Engine, prompts: list[list[int]], args: argparse.Namespace, sizes: Sizes, touched: float
) -> dict[str, Any]:
    """The timed run, its mean decode step and that step's bound (printed; returned as the record's `run`)."""
    rows, device = args.prompts * args.n, engine.device
    _, prefill_s = timed(lambda: engine.generate(prompts, SamplingParams(n=args.n, max_tokens=1, seed=2)), device)
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_new_tokens, seed=0)
    outputs, run_s = timed(lambda: engine.generate(prompts, params), device)
    generated = sum(len(s.token_ids) for o in outputs for s in o.samples)
    stats = engine.last_stats
    assert stats is not None
    step_ms = (run_s - prefill_s) / max(stats.decode_steps, 1) * 1e3
    context = args.prompt_tokens + args.max_new_tokens / 2
    bound_ms = step_bound_s(sizes, rows, context, touched) * 1e3
    every_expert_ms = step_bound_s(sizes, rows, context, sizes.moe_layers * sizes.experts_per_layer) * 1e3
    print(
        f"run: {rows} samples x ({args.prompt_tokens} + {args.max_new_tokens}) tokens, {generated} generated in "
        f"{run_s:.1f} s ({generated / run_s:,.0f} tokens/s): {stats.decode_steps} decode steps, "
        f"{stats.prefill_steps} prefill; prefill alone {prefill_s:.2f} s"
    )
    kv_gb = rows * context * sizes.kv_bytes_per_token / 1e9
    ratio = step_ms / bound_ms
    print(
        f"mean decode step {step_ms:.2f} ms; its memory bound {bound_ms:.2f} ms (dense {sizes.dense_bytes / 1e9:.2f} "
        f"GB + {touched:.0f} experts touched {touched * sizes.expert_bytes / 1e9:.2f} GB + KV at {context:.0f} "
        f"tokens {kv_gb:.2f} GB, at {H200_BYTES_PER_S / 1e12:.1f} TB/s; with every expert: {every_expert_ms:.2f} "
        f"ms): {ratio:.2f}x the bound ({'within' if ratio <= 2 else 'NOT within'} 2x)"
    )
    return {
        "samples": rows,
        "generated_tokens": generated,
        "wall_s": run_s,
        "prefill_s": prefill_s,
        "decode_steps": stats.decode_steps,
        "prefill_steps": stats.prefill_steps,
        "decode_step_ms": step_ms,
        "bound_ms": bound_ms,
        "bound_every_expert_ms": every_expert_ms,
        "x_bound": ratio,
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    config = hf_config(args)
    device = torch.device(args.device)
    name = f"{args.model}{' (tiny)' if args.tiny else ''}"
    print(
        f"device: {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}"
    )
    engine = build_engine(args, config)
    _, load_s = timed(lambda: engine.load_weights(random_weights(engine.model, device)), device)
    engine.check_loaded()
    sizes = model_sizes(engine.model, engine.kv_bytes_per_token)
    print(
        f"{name}: {config['num_hidden_layers']} layers, {sizes.weight_bytes / 1e9:.2f} GB of weights "
        f"({sizes.moe_layers} MoE layers of {sizes.experts_per_layer} experts, {sizes.expert_bytes / 1e6:.1f} MB "
        f"each; dense {sizes.dense_bytes / 1e9:.2f} GB), drawn on {device.type} in {load_s:.1f} s; "
        f"experts through {engine.model.moe_kernel} ({engine.model.moe_sort} sort), decode attention "
        f"{engine.model.decode_kernel}; KV cache "
        f"{engine.config.kv_cache_memory_bytes / 1e9:.1f} GB"
    )
    record: dict[str, Any] = {"model": name, "args": {k: str(v) for k, v in vars(args).items()}, "sizes": asdict(sizes)}
    record |= {"layers": config["num_hidden_layers"], "moe_kernel": engine.model.moe_kernel}
    record["moe_sort"] = engine.model.moe_sort
    record["decode_attention"] = engine.model.decode_kernel

    def save() -> None:
        if args.json:
            args.json.write_text(json.dumps(record, indent=1))

    prompts = random_prompts(args.prompts, args.prompt_tokens, engine.model_config.vocab_size)
    record["experts_touched"] = touched = count_touched(engine, prompts, args)
    print(f"experts a decode step touches: {touched / sizes.moe_layers:.1f} of {sizes.experts_per_layer} a layer")
    record["graph_capture_s"] = capture_graphs(engine, args)
    record["run"] = run_generation(engine, prompts, args, sizes, touched)
    save()
    last = engine.config.max_model_len
    contexts = sorted(
        {min(c, last) for c in (args.prompt_tokens + 16, args.prompt_tokens + args.max_new_tokens // 2, last)}
    )
    record["profile"] = profile_steps(engine, sizes, args.prompts * args.n, contexts)
    save()
    if args.sweep_tiles:
        record["sweep"] = sweep_tiles(engine, sizes, args.prompts * args.n)
        save()
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device) / 1e9
        print(f"CUDA graphs: {engine.num_cuda_graphs}; peak memory {peak:.1f} GB")


if __name__ == "__main__":
    main()
