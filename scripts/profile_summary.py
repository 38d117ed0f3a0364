"""Where one profiled piece of GPU work spends its time: a short text summary of a `torch.profiler` run.

`profile_call(fn, label)` runs `fn` once under the profiler (CPU and CUDA activity) and returns a summary:
- wall time of the call and the time some kernel was running (the union of kernel intervals over all streams), so
  `busy / wall` below 1 means the device waited for the host (launch overhead or host synchronisations);
- the number of kernels and of host-device synchronisation events (`cudaStreamSynchronize`,
  `cudaDeviceSynchronize`, `cudaEventSynchronize`, and `aten::_local_scalar_dense`: an `item()` counts as two, its
  read and the stream synchronisation it waits on);
- kernel time by kind (matrix products, attention, communication, the rest) and the top kernels by total time.

Assumes a CUDA device (on CPU the summary has no kernels and says so). Used by `bench_training.py --profile`.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "flex")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma")),
)
"""Kernel kinds by lower-case name fragments; the first match wins, anything else is "other"."""

SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, fragments in KINDS:
        if any(fragment in lowered for fragment in fragments):
            return kind
    return "other"


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of `(start, end)` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def profile_call(fn: Callable[[], None], label: str, top: int = 12) -> str:
    """Run `fn` once under the profiler (the device synchronised before and after) and summarise it."""
    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        wall_us = (time.perf_counter() - start) * 1e6
    kernels: list[tuple[str, float, float]] = []
    syncs = 0
    for event in prof.events():
        if event.device_type == DeviceType.CUDA:
            kernels.append((event.name, event.time_range.start, event.time_range.end))
        elif any(name in event.name for name in SYNC_NAMES):
            syncs += 1
    if not kernels:
        return f"profile {label}: wall {wall_us / 1e3:.1f} ms, no device kernels recorded"
    busy = union_us([(start, end) for _, start, end in kernels])
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for name, start, end in kernels:
        by_kind[kernel_kind(name)] += end - start
        by_name[name][0] += end - start
        by_name[name][1] += 1
    total = sum(by_kind.values())
    lines = [
        f"profile {label}: wall {wall_us / 1e3:.1f} ms, device busy {busy / 1e3:.1f} ms "
        f"({100 * busy / wall_us:.0f}%), {len(kernels)} kernels, {syncs} host syncs",
        "  kernel time by kind: "
        + ", ".join(f"{kind} {t / 1e3:.1f} ms ({100 * t / total:.0f}%)" for kind, t in sorted(by_kind.items())),
    ]
    for name, (t, count) in sorted(by_name.items(), key=lambda item: -item[1][0])[:top]:
        lines.append(f"  {t / 1e3:8.2f} ms {count:6d}x  {name[:110]}")
    return "\n".join(lines)
