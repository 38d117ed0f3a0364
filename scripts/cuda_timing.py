"""Per-call times of a small GPU function for the benchmark scripts: CUDA-graph replays of many calls.

One kernel call of a decode step lasts microseconds, shorter than its launch: timing calls one by one measures the
host. `graph_call_times_us` warms the function up on a side stream, captures `calls` calls in one CUDA graph and
times `replays` replays with CUDA events, giving microseconds per call for each replay. Off CUDA (the scripts' CPU
smoke runs) it times `host_calls` plain calls on the host instead.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def graph_call_times_us(
    fn: Callable[[], object], device: torch.device, *, calls: int = 20, replays: int = 7, host_calls: int = 3
) -> list[float]:
    """Microseconds per call of `fn`, one figure per graph replay (per host-timed call off CUDA)."""
    if device.type != "cuda":
        times = []
        for _ in range(host_calls):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return times
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return times
