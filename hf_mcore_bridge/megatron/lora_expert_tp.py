"""The communication of routed experts' LoRA adapters under expert tensor parallelism (ETP > 1).

megatron-core's experts leave their tensor-parallel reductions to the token dispatcher: every rank of the expert
tensor-parallel group runs the same (gathered) tokens; `linear_fc1` (column-split) takes the whole input and
gives this rank's output rows, and the gradient of that input is this rank's partial sum; `linear_fc2` (row-split)
takes this rank's input columns and gives a partial sum of the output. The dispatcher sums the partial outputs
(reduce-scatter) and, in the backward of its all-gather, the input's partial gradients. An expert's adapter
therefore keeps those conventions:

- `linear_fc1`: A whole, B split by rows as the weight ([gate_r; up_r] of the fused rows). The rank-r activation
  A x is reduced in the backward over the expert tensor-parallel group (megatron-core's
  `copy_to_tensor_model_parallel_region`), so A's gradient is complete on every rank; the adapter's part of x's
  gradient, then whole on every rank, is divided by the group size (`grad_shared`) for the dispatcher's sum.
- `linear_fc2`: A split by columns as the weight, B whole. A_local h_local is all-reduced in the forward
  (`reduce_from_tensor_model_parallel_region`, backward the identity); the product s B (A h), whole on every
  rank, is divided by the group size in the forward only (`output_shared`) so the dispatcher's sum is the product
  once, while B's gradient (the output's gradient is whole on every rank) is complete on every rank.

At a group size of 1 all of these are the identity. Exact for a group size that is a power of two (the division
and the dispatcher's sum of equal halves are exact in floating point).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["column_low", "grad_shared", "output_shared", "row_output"]


class _GradShared(torch.autograd.Function):
    """Forward the identity; backward the gradient divided by `size`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, size: int) -> torch.Tensor:
        ctx.size = size
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad / ctx.size, None


class _OutputShared(torch.autograd.Function):
    """Forward divided by `size`; backward the identity."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, size: int) -> torch.Tensor:
        return y / size

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


def grad_shared(x: torch.Tensor, size: int) -> torch.Tensor:
    """`x`, whose gradient the dispatcher sums over `size` ranks that each compute it whole: 1 / size of it each."""
    return x if size == 1 else _GradShared.apply(x, size)


def output_shared(y: torch.Tensor, size: int) -> torch.Tensor:
    """`y`, whole on each of `size` ranks whose outputs the dispatcher sums: 1 / size of it each (forward only)."""
    return y if size == 1 else _OutputShared.apply(y, size)


def column_low(x: torch.Tensor, low: Any, group: Any, size: int) -> torch.Tensor:
    """A `linear_fc1` adapter's rank-r activation `low(x)` (A x, whole on every rank), its gradient reduced over the
    expert tensor-parallel `group` of `size` ranks, the adapter's part of x's gradient shared out (module doc)."""
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    if size == 1:
        return low(x)
    return copy_to_tensor_model_parallel_region(low(grad_shared(x, size)), group=group)


def row_output(h: torch.Tensor, low: Any, up: Any, group: Any, size: int) -> torch.Tensor:
    """A `linear_fc2` adapter's output `up(low(h))` (s B A_local h_local summed over the group), as this rank's
    share of the dispatcher's sum (module doc)."""
    from megatron.core.tensor_parallel import reduce_from_tensor_model_parallel_region

    if size == 1:
        return up(low(h))
    return output_shared(up(reduce_from_tensor_model_parallel_region(low(h), group=group)), size)
