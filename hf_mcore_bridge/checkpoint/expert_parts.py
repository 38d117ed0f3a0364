"""How one expert's HF tensor is cut from a fused `[num_experts, ...]` tensor and put back (`fused_experts`).

A fused tensor holds every expert of a layer along its first axis; the table names each expert's tensors in the
orientation of a linear layer (`[out, in]`, as megatron-core holds them). A *part* says how one expert's slice of
the fused tensor gives such a tensor:

- `all`: the slice itself (Mixtral's router, a down projection stored `[H, F]`, a bias);
- `gate`, `up`: the first / second half of the slice's rows (transformers 5's `gate_up_proj` `[E, 2F, H]`);
- `even_t`, `odd_t`: the even / odd columns of the slice's last axis, transposed (GPT-OSS's `gate_up_proj`
  `[E, H, 2F]` with gate and up interleaved, and its `gate_up_proj_bias` `[E, 2F]`);
- `t`: the slice transposed (GPT-OSS's `down_proj` `[E, F, H]`).

The parts of one fused tensor together hold every element of the slice exactly once, so `join` (export) is the
inverse of `take` (import). Shapes are computed without torch; `take` and `join` import it when they run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

PARTS = ("all", "gate", "up", "even_t", "odd_t", "t")
"""Every part a fused-expert rule may name."""

_PAIRS = {"gate": ("gate", "up"), "up": ("gate", "up"), "even_t": ("even_t", "odd_t"), "odd_t": ("even_t", "odd_t")}


def _check(part: str) -> None:
    if part not in PARTS:
        raise ValueError(f"unknown fused-expert part {part!r} (one of {', '.join(PARTS)})")


def _transposed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(reversed(shape)) if len(shape) == 2 else shape


def part_shape(part: str, fused: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of one expert's tensor, from the shape of its slice of the fused tensor (expert axis dropped)."""
    _check(part)
    if not fused or part == "all":
        return fused
    if part in ("gate", "up"):
        return (fused[0] // 2, *fused[1:])
    if part == "t":
        return _transposed(fused)
    return _transposed((*fused[:-1], fused[-1] // 2))


def fused_shape(part: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the fused tensor's slice, from one expert's tensor of `part` (the inverse of `part_shape`)."""
    _check(part)
    if not shape or part == "all":
        return shape
    if part in ("gate", "up"):
        return (2 * shape[0], *shape[1:])
    if part == "t":
        return _transposed(shape)
    slice_ = _transposed(shape)
    return (*slice_[:-1], 2 * slice_[-1])


def take(slice_: torch.Tensor, part: str) -> torch.Tensor:
    """One expert's tensor of `part` from its slice of the fused tensor (contiguous)."""
    _check(part)
    if part in ("gate", "up"):
        half = slice_.shape[0] // 2
        slice_ = slice_[:half] if part == "gate" else slice_[half:]
    elif part in ("even_t", "odd_t"):
        slice_ = slice_[..., 0 if part == "even_t" else 1 :: 2]
        slice_ = slice_.T if slice_.dim() == 2 else slice_
    elif part == "t" and slice_.dim() == 2:
        slice_ = slice_.T
    return slice_.contiguous()


def join(tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """One expert's slice of the fused tensor from its tensors by part (`all` or `t` alone, or both parts of a
    pair): the inverse of `take`. ValueError: parts that do not make a whole slice."""
    import torch

    parts = sorted(tensors)
    if parts in (["all"], ["t"]):
        (part,) = parts
        value = tensors[part]
        return (value.T if part == "t" and value.dim() == 2 else value).contiguous()
    pair = _PAIRS.get(parts[0]) if parts else None
    if pair is None or sorted(pair) != parts:
        raise ValueError(f"fused-expert parts {parts} do not make one expert's slice")
    first, second = (tensors[p] for p in pair)
    if pair == ("gate", "up"):
        return torch.cat((first, second), dim=0)
    if first.dim() == 2:
        first, second = first.T, second.T
    return torch.stack((first, second), dim=-1).flatten(-2).contiguous()
