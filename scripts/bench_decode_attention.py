"""Decode attention kernels side by side on one layer of the paged KV cache: the Triton kernel (at several tile,
warp and pipeline-stage settings), compiled FlexAttention and SDPA over gathered blocks (CUDA).

Each case is one decode step's attention for `batch` sequences of `context` tokens (Llama-3.2-1B's attention by
default: 32 query heads, 8 KV heads of 64, 32-token blocks, bf16), the blocks scattered through a cache sized for
the batch. Every kernel is timed with CUDA graphs of 20 calls (so launch overhead is not counted) and checked
against the gathered-SDPA output first. The bandwidth column is the KV bytes the step must read (each sequence's
keys and values once) over the kernel's time; the H200's HBM peak is 4.8 TB/s.

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/bench_decode_attention.py                      # default cases and settings
    python scripts/bench_decode_attention.py --case 512x640 --case 4x16384 --json out.json
    TRITON_INTERPRET=1 python scripts/bench_decode_attention.py --device cpu --case 2x64   # CPU smoke test

The engine's choices (`triton_decode.TILE_TOKENS`, `num_splits`, `NUM_WARPS`, `NUM_STAGES`) were made from this
table (`docs/PERFORMANCE.md`); rows marked (auto) are what the engine would pick.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import torch
import typer
from cuda_timing import graph_call_times_us

from hf_mcore_bridge.engine import triton_decode
from hf_mcore_bridge.engine.attention import DecodeMetadata, decode_attention, with_block_mask

DEFAULT_CASES = ["512x64", "512x320", "512x640", "64x2048", "8x8192", "1x32768"]


def _case(text: str) -> tuple[int, int]:
    batch, context = text.lower().split("x")
    return int(batch), int(context)


def _time_us(fn: Callable[[], torch.Tensor], device: torch.device, calls: int = 20, repeats: int = 10) -> float:
    """Median microseconds per call, replaying a CUDA graph of `calls` calls (off CUDA: one call, host-timed)."""
    times = graph_call_times_us(fn, device, calls=calls, replays=repeats, host_calls=1)
    return sorted(times)[len(times) // 2]


def run_case(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block: int,
    settings: list[tuple[int, int, int, int]],
    device: torch.device,
) -> list[dict[str, object]]:
    torch.manual_seed(0)
    n_blocks = -(-context // block)
    num_blocks = batch * n_blocks + 1
    cache = torch.randn(2, num_blocks, block, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    tables = (torch.randperm(num_blocks - 1, device=device)[: batch * n_blocks] + 1).view(batch, n_blocks)
    lengths = torch.full((batch,), context, dtype=torch.int64, device=device)
    q = torch.randn(batch, heads, head_dim, dtype=torch.bfloat16, device=device)
    meta = DecodeMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.int64, device=device), block_tables=tables, context_lens=lengths
    )
    reference = decode_attention(q, cache, meta, head_dim**-0.5)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * cache.element_size()
    rows: list[dict[str, object]] = []

    def record(name: str, fn: Callable[[], torch.Tensor]) -> None:
        error = (fn().float() - reference.float()).abs().max().item()
        if error > 2e-2:
            raise SystemExit(f"{name} at {batch}x{context}: max |error| {error:.3g} against gathered SDPA")
        us = _time_us(fn, device)
        rows.append(
            {
                "batch": batch,
                "context": context,
                "kernel": name,
                "us": round(us, 1),
                "tb_per_s": round(kv_bytes / us / 1e6, 2),
                "max_abs_error": error,
            }
        )
        print(f"{batch:>5} x {context:<6} {name:<44} {us:>9.1f} us {kv_bytes / us / 1e6:>6.2f} TB/s", flush=True)

    gather_meta = DecodeMetadata(meta.slot_mapping, tables, lengths)
    record("gather (SDPA)", lambda: decode_attention(q, cache, gather_meta, head_dim**-0.5))
    flex_meta = with_block_mask(meta, block, num_blocks)
    flex_name = "flex (compiled)" if device.type == "cuda" else "flex (eager)"
    record(flex_name, lambda: decode_attention(q, cache, flex_meta, head_dim**-0.5))
    sms = triton_decode.device_sm_count(device)
    seen = set()
    for tile, warps, stages, splits in settings:
        triton_decode.NUM_WARPS, triton_decode.NUM_STAGES = warps, stages
        if splits > 1 and (batch * kv_heads >= 2 * sms or splits * triton_decode.MIN_BLOCKS_PER_SPLIT > n_blocks):
            continue  # the batch fills the GPU, or ranges shorter than the kernel would ever use
        chosen = splits or triton_decode.num_splits(batch, kv_heads, n_blocks, sms)
        per_split = -(-n_blocks // chosen)
        blocks = tile or triton_decode.tile_blocks(block, per_split)
        if (blocks, warps, stages, chosen) in seen and not (tile == 0 and splits == 0):
            continue
        seen.add((blocks, warps, stages, chosen))

        def call(chosen: int = chosen, blocks: int = blocks) -> torch.Tensor:
            return triton_decode.paged_decode_attention(q, cache, tables, lengths, head_dim**-0.5, chosen, blocks)

        name = f"triton tile={blocks}{'' if tile else '(auto)'} w={warps} s={stages} splits={chosen}"
        record(name + ("" if splits else "(auto)"), call)
    return rows


CASE_OPTION = typer.Option(DEFAULT_CASES, help="BATCHxCONTEXT (repeatable).")
TILE_OPTION = typer.Option([0, 2, 4], help="Triton: KV blocks per tile, 0 for the engine's choice (repeatable).")
WARPS_OPTION = typer.Option([4], help="Triton: warps per program (repeatable).")
STAGES_OPTION = typer.Option([2], help="Triton: software-pipeline stages (repeatable).")
SPLITS_OPTION = typer.Option([0, 8, 32], help="Triton: split-KV ranges, 0 for the engine's choice (repeatable).")
JSON_OPTION = typer.Option(None, "--json", help="Write the rows here.")
DEVICE_OPTION = typer.Option(
    "cuda", help="cuda, or cpu: a smoke test in Triton's interpreter (TRITON_INTERPRET=1), timed on the host."
)


def main(
    case: list[str] = CASE_OPTION,
    tile_blocks: list[int] = TILE_OPTION,
    warps: list[int] = WARPS_OPTION,
    stages: list[int] = STAGES_OPTION,
    splits: list[int] = SPLITS_OPTION,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 64,
    block_size: int = 32,
    json_out: Path | None = JSON_OPTION,
    device: str = DEVICE_OPTION,
) -> None:
    on = torch.device(device)
    if on.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_decode_attention.py: no CUDA device (--device cpu runs Triton's interpreter)")
    name = torch.cuda.get_device_name() if on.type == "cuda" else "CPU, Triton interpreter"
    print(
        f"{name}; engine defaults: tiles of {triton_decode.TILE_TOKENS} tokens, "
        f"warps={triton_decode.NUM_WARPS} stages={triton_decode.NUM_STAGES}"
    )
    settings = list(itertools.product(tile_blocks, warps, stages, splits))
    rows = []
    for text in case:
        batch, context = _case(text)
        rows += run_case(batch, context, heads, kv_heads, head_dim, block_size, settings, on)
    if json_out is not None:
        json_out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    typer.run(main)
