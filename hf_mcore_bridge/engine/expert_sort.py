"""The sort of a MoE layer's (token, expert) pairs by expert, on the device, for the grouped GEMMs of `fused_moe`.

The T x k pairs (flat index token * k + slot) are sorted by expert, stably (a pair keeps its place among its
expert's pairs); each expert's rows start at a multiple of `block_m` in a buffer of fixed capacity
(`sort_capacity`: T * k plus, per expert that can occur, up to `block_m - 1` padding rows, which hold the value
T * k), and a block -> expert table names the expert of every `block_m` rows (-1: past the last expert's rows).
vLLM's `moe_align_block_size`. Nothing is read on the host and every shape depends only on T * k, so the sort is
captured in a CUDA graph.

Two implementations give identical outputs (`ExpertSort`, field by field), chosen by `sort_experts`' `method`
(`options.MOE_SORTS`, the engine's `EngineConfig.moe_sort`):

- `torch`: `sort_by_expert`, about fifteen small torch kernels (scatter_add, cumsum, a stable argsort,
  index_select, searchsorted, ...; no `bincount`, whose CUDA kernel reads the largest id on the host).
- `triton`: `sort_by_expert_triton`, one Triton kernel launch (`expert_sort_kernel`), a single program, for up to
  `MAX_SORT_PAIRS` pairs over up to `MAX_SORT_EXPERTS` experts (decode batches; the sort of larger ones falls back to
  `sort_by_expert`). It replaces the torch sort's small kernels in every MoE layer of a decode step, and is the
  engine's choice on CUDA (`EngineConfig.moe_sort` `auto`): on one H200, one Qwen3-30B-A3B MoE layer's experts at
  64 rows took 0.311 ms with it against 0.448 ms with the torch sort (`scripts/bench_moe_generation.py
  --sweep-tiles`). Tested against a reference in Triton's interpreter (`TRITON_INTERPRET=1`, CPU tensors) and on
  the GPU. Triton itself is imported only when the kernel is first used.

Expert ids must lie in [0, num_experts) (neither implementation checks: torch's scatter fails on others, the
kernel's output is then undefined).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from hf_mcore_bridge.engine.options import MOE_SORTS

MAX_SORT_PAIRS = 4096
"""Pairs (T * k) the Triton sort takes at most: its single program holds one sort key per pair in registers."""
MAX_SORT_EXPERTS = 1024
"""Experts the Triton sort takes at most (its histogram and cumulative sums are one vector of that many entries)."""
FILL = 1024
"""Rows the Triton sort sets to padding per step of its fill loop (the capacity is not bounded by the limits)."""
NUM_WARPS = 4


@dataclass(frozen=True)
class ExpertSort:
    """The (token, expert) pairs sorted by expert, each expert's rows padded to a multiple of `block_m`."""

    sorted_pairs: torch.Tensor
    """[capacity] int64: the flat pair index (token * k + slot) of each sorted row; `num_pairs` on padding rows."""
    block_expert: torch.Tensor
    """[capacity / block_m] int64: the expert of each block of `block_m` rows; -1 past the last expert's rows."""
    group_ends: torch.Tensor
    """[E] int64: where each expert's padded rows end (cumulative; an expert without pairs ends where the one
    before it does)."""
    num_pairs: int
    block_m: int


def sort_capacity(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the sorted buffer: every pair, plus up to `block_m - 1` padding rows for each expert that can have
    pairs (at most one per pair), rounded up to whole blocks."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return -(-padded // block_m) * block_m


def check_sort(method: str) -> None:
    """Raises ValueError, in one line, for a `method` that is not one of `options.MOE_SORTS`."""
    if method not in MOE_SORTS:
        raise ValueError(f"moe_sort must be one of {', '.join(MOE_SORTS)}, got {method!r}")


def sort_experts(experts: torch.Tensor, num_experts: int, block_m: int, method: str = "torch") -> ExpertSort:
    """The pairs of `experts` [T, k] sorted by expert through `method` (`options.MOE_SORTS`)."""
    check_sort(method)
    if method == "triton":
        return sort_by_expert_triton(experts, num_experts, block_m)
    return sort_by_expert(experts, num_experts, block_m)


def sort_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """Sorts the pairs of `experts` [T, k] (expert ids) by expert on their device in torch ops, with no host sync
    and shapes that depend only on T * k."""
    flat = experts.flatten()
    pairs = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    group_ends = torch.cumsum(padded_counts, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat.index_select(0, order)
    first_row = torch.cumsum(counts, 0) - counts  # of each expert among the unpadded sorted pairs
    rank = torch.arange(pairs, device=flat.device) - first_row.index_select(0, sorted_experts)
    destination = (group_ends - padded_counts).index_select(0, sorted_experts) + rank
    capacity = sort_capacity(pairs, num_experts, block_m)
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int64, device=flat.device)
    sorted_pairs.scatter_(0, destination, order)
    block_start = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(group_ends, block_start, right=True)
    block_expert = torch.where(block_start < group_ends[-1], block_expert, -1)
    return ExpertSort(sorted_pairs, block_expert, group_ends, pairs, block_m)


def triton_sort_fits(num_pairs: int, num_experts: int) -> bool:
    """Whether `sort_by_expert_triton` sorts `num_pairs` pairs over `num_experts` experts in its kernel (else it
    falls back to `sort_by_expert`)."""
    return 0 < num_pairs <= MAX_SORT_PAIRS and 0 < num_experts <= MAX_SORT_EXPERTS


def sort_by_expert_triton(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertSort:
    """`sort_by_expert` in one Triton kernel launch (CUDA tensors; CPU ones in Triton's interpreter), with no host
    sync and the same outputs; `sort_by_expert` itself where the sizes exceed `triton_sort_fits`."""
    flat = experts.flatten()
    pairs = flat.numel()
    if not triton_sort_fits(pairs, num_experts):
        return sort_by_expert(experts, num_experts, block_m)
    capacity = sort_capacity(pairs, num_experts, block_m)
    device = flat.device
    order = ExpertSort(
        sorted_pairs=torch.empty(capacity, dtype=torch.int64, device=device),
        block_expert=torch.empty(capacity // block_m, dtype=torch.int64, device=device),
        group_ends=torch.empty(num_experts, dtype=torch.int64, device=device),
        num_pairs=pairs,
        block_m=block_m,
    )
    _launch(flat, num_experts, order)
    return order


def _launch(flat: torch.Tensor, num_experts: int, order: ExpertSort) -> None:
    """The kernel over `flat` [P] expert ids, writing `order`'s tensors (replaced by a recorder on meta tensors in
    the tests, which launch nothing)."""
    shift = torch.empty(num_experts, dtype=torch.int32, device=flat.device)
    interpret = flat.device.type != "cuda"
    _kernel()[(1,)](
        flat,
        order.sorted_pairs,
        order.block_expert,
        order.group_ends,
        shift,
        order.num_pairs,
        num_experts,
        order.sorted_pairs.numel(),
        BLOCK_M=order.block_m,
        PAIRS_PAD=_power_of_two(order.num_pairs, 16),
        # at least a warp's 32 bins: older Triton versions' histogram lowers with one bin or more per lane
        EXPERTS_PAD=_power_of_two(num_experts, 32),
        FILL=FILL,
        **({} if interpret else {"num_warps": NUM_WARPS}),
    )


def _power_of_two(value: int, least: int) -> int:
    return max(least, 1 << (value - 1).bit_length())


@functools.cache
def _kernel() -> Any:
    import triton

    from hf_mcore_bridge.engine.expert_sort_kernel import expert_sort_kernel

    return triton.jit(expert_sort_kernel)
