"""The refit's transfer check (`grpo.refit.tensor_checksums`) on a model's tensors, beside a device-to-device copy.

Builds bf16 tensors of a shape from `scripts/random_checkpoint.py` (default Llama-3.2-1B) on the GPU and times,
side by side in one process, `tensor_checksums` over all of them (what every refit runs on the engine's tensors)
and a copy of the same bytes (the floor of reading them once and writing them once); medians of `--iters` runs
with min-max, timed with CUDA events, and the bandwidth bound of one read (bytes / 4.3 TB/s on an H200).

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/bench_refit_check.py                 # on a GPU
    python scripts/bench_refit_check.py --tiny          # CPU smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_mcore_bridge.grpo.refit import tensor_checksums


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


def _time(fn, iters: int, cuda: bool) -> list[float]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--iters", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.tiny
    device = "cuda" if cuda else "cpu"
    tensors = [torch.randn(s, device=device).to(torch.bfloat16) for s in _shapes(args.tiny)]
    copies = [torch.empty_like(t) for t in tensors]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    rows = {
        "tensor_checksums": _time(lambda: tensor_checksums(tensors), args.iters, cuda),
        "device-to-device copy": _time(lambda: torch._foreach_copy_(copies, tensors), args.iters, cuda),
    }
    print(
        f"{len(tensors)} tensors, {nbytes / 1e9:.2f} GB bf16 on {device}; read once at 4.3 TB/s: "
        f"{nbytes / 4.3e12 * 1e3:.2f} ms"
    )
    for name, times in rows.items():
        print(
            f"{name:24s} median {statistics.median(times) * 1e3:8.2f} ms  "
            f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}, {len(times)} runs)"
        )
    ratio = statistics.median(rows["tensor_checksums"]) / statistics.median(rows["device-to-device copy"])
    print(f"check / copy: {ratio:.1f}x")


if __name__ == "__main__":
    main()
