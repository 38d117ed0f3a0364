"""The refit's transfer check (`grpo.refit.checksums.tensor_checksums`) on a model's tensors, beside a copy.

Builds bf16 tensors of a shape from `scripts/random_checkpoint.py` (default Llama-3.2-1B: 98 tensors, 2.47 GB) on
the GPU and times, side by side in one process, `tensor_checksums` over all of them (what every refit runs on the
engine's tensors, eagerly and as part of a recorded refit: both are timed) and a device-to-device copy of the same
bytes (the tensors' multi-tensor copy, which the ratio is taken against, and one memcpy of a buffer as large):
medians of `--iters` runs with min-max, timed with CUDA events, and the bounds set by memory bandwidth (the hash
reads the bytes once, a copy reads and writes them: bytes / `--bandwidth`). It then checks, on the same tensors,
that the Triton kernels' rows equal the torch path's and that a replay of the recorded check sees a one-bit change
made after the recording (exit status 1 otherwise). `--sweep` also times other shapes of the kernel's programs
(elements per iteration, iterations, warps).

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/bench_refit_check.py                 # on a GPU
    python scripts/bench_refit_check.py --tiny          # CPU smoke run (the torch path)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from hf_mcore_bridge.grpo.refit.checksums import tensor_checksums

SWEEP = ((2048, 4, 8), (1024, 4, 8), (4096, 1, 8), (2048, 1, 8), (1024, 4, 4))
"""(elements per iteration, iterations, warps) of the flat kernel's programs timed by `--sweep`."""


def _shapes(tiny: bool) -> list[tuple[int, ...]]:
    hidden, inter, layers, vocab, kv = (64, 128, 2, 256, 32) if tiny else (2048, 8192, 16, 128256, 512)
    per_layer = [
        (hidden + 2 * kv, hidden),
        (hidden, hidden),
        (2 * inter, hidden),
        (hidden, inter),
        (hidden,),
        (hidden,),
    ]
    return [(vocab, hidden)] + per_layer * layers + [(hidden,)]


def _time(fn: Callable[[], object], iters: int, cuda: bool) -> list[float]:
    times = []
    for _ in range(iters + 1):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return times[1:]  # the first is the warm-up


def _recorded(tensors: list[torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """`tensor_checksums` recorded as a CUDA graph (after an eager call, as a refit is) and its output."""
    tensor_checksums(tensors)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        tensor_checksums(tensors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tensor_checksums(tensors)
    return graph, out


def _check_on_gpu(tensors: list[torch.Tensor], graph: torch.cuda.CUDAGraph, out: torch.Tensor) -> list[str]:
    """Problems found: Triton's rows against the torch path's, and a replay after a one-bit change."""
    problems = []
    triton_rows = tensor_checksums(tensors, backend="triton")
    if not torch.equal(triton_rows, tensor_checksums(tensors, backend="torch")):
        problems.append("the triton kernels' rows differ from the torch path's")
    flipped = len(tensors) // 2
    tensors[flipped].view(-1).view(torch.int16)[12345 % tensors[flipped].numel()] ^= 1 << 3
    graph.replay()
    eager = tensor_checksums(tensors)
    changed = (out != triton_rows).any(1).nonzero().flatten().tolist()
    if not torch.equal(out, eager) or changed != [flipped]:
        problems.append(f"the replay after a one-bit change in tensor {flipped} changed rows {changed}")
    return problems


def _sweep(tensors: list[torch.Tensor], iters: int) -> dict[str, list[float]]:
    from hf_mcore_bridge.grpo.refit import checksum_kernel as kernel

    saved = kernel.BLOCK, kernel.ITERS, kernel.NUM_WARPS
    rows = {}
    try:
        for kernel.BLOCK, kernel.ITERS, kernel.NUM_WARPS in SWEEP:
            label = f"  programs {kernel.BLOCK}x{kernel.ITERS}, {kernel.NUM_WARPS} warps"
            rows[label] = _time(lambda: tensor_checksums(tensors), iters, True)
    finally:
        kernel.BLOCK, kernel.ITERS, kernel.NUM_WARPS = saved
    return rows


def _print_row(name: str, times: list[float], nbytes_read: int) -> None:
    median = statistics.median(times)
    print(
        f"{name:34s} median {median * 1e3:8.3f} ms  (min {min(times) * 1e3:.3f}, max {max(times) * 1e3:.3f}, "
        f"{len(times)} runs; {nbytes_read / median / 1e12:.2f} TB/s read)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny shape (on CPU: the torch path)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--bandwidth", type=float, default=4.8, help="memory bandwidth in TB/s (H200: 4.8)")
    parser.add_argument("--sweep", action="store_true", help="also time other shapes of the kernel's programs")
    args = parser.parse_args()
    if args.iters < 1 or args.bandwidth <= 0:
        parser.error("--iters must be at least 1 and --bandwidth positive")
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    tensors = [torch.randn(s, device=device).to(torch.bfloat16) for s in _shapes(args.tiny)]
    copies = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    bandwidth = args.bandwidth * 1e12
    print(
        f"{len(tensors)} tensors, {nbytes / 1e9:.2f} GB bf16 on {device}; at {args.bandwidth} TB/s one read takes "
        f"{nbytes / bandwidth * 1e3:.3f} ms (the hash's bound), a read and a write {2 * nbytes / bandwidth * 1e3:.3f} "
        f"ms (the copy's)"
    )
    rows = {"tensor_checksums": _time(lambda: tensor_checksums(tensors), args.iters, cuda)}
    if cuda:
        graph, out = _recorded(tensors)
        rows["tensor_checksums, recorded (replay)"] = _time(graph.replay, args.iters, cuda)
        if args.sweep:
            rows.update(_sweep(tensors, args.iters))
    rows["device-to-device copy"] = _time(lambda: torch._foreach_copy_(copies, tensors), args.iters, cuda)
    source = torch.empty(nbytes, dtype=torch.uint8, device=device)  # the same bytes in one buffer
    target = torch.empty_like(source)
    rows["one memcpy of as many bytes"] = _time(lambda: target.copy_(source), args.iters, cuda)
    for name, times in rows.items():
        _print_row(name, times, nbytes)
    if cuda:
        problems = _check_on_gpu(tensors, graph, out)
        print("checks: " + ("; ".join(problems) if problems else "triton rows == torch path's; replay sees a bit flip"))
        if problems:
            sys.exit(1)
    check = statistics.median(rows["tensor_checksums"])
    print(f"check / one memcpy: {check / statistics.median(rows['one memcpy of as many bytes']):.2f}x")
    print(f"check / copy: {check / statistics.median(rows['device-to-device copy']):.2f}x")


if __name__ == "__main__":
    main()
