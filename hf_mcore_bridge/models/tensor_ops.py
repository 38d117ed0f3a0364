"""Pure tensor transforms between HF and megatron-core layouts. No I/O, no process groups.

Shapes use: nh = attention heads, ng = query groups (KV heads), d = head dim, H = hidden size,
F = FFN width, V = vocabulary, Vp = padded vocabulary. torch is imported by the functions that make tensors, so
the shape and chunk arithmetic (`shard_boxes`, `padded_vocab_size`, ...) is there for planning without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_mcore_bridge.models.parallel_style import Parallel

if TYPE_CHECKING:
    import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]
"""A chunk of a global tensor: (offsets, sizes)."""


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_query_groups: int) -> torch.Tensor:
    """HF's separate projections -> megatron's per-group interleaved `linear_qkv`.

    q: [nh*d, ...], k: [ng*d, ...], v: [ng*d, ...] -> [ng * (nh/ng + 2) * d, ...], laid out per query group as
    (its nh/ng q heads, its k head, its v head). Works for weights ([., H]) and biases ([.]).
    """
    import torch

    ng = num_query_groups
    tail = q.shape[1:]
    grouped = (q.reshape(ng, -1, *tail), k.reshape(ng, -1, *tail), v.reshape(ng, -1, *tail))
    return torch.cat(grouped, dim=1).reshape(-1, *tail)


def split_qkv(
    qkv: torch.Tensor, num_attention_heads: int, num_query_groups: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_qkv`: [ng * (nh/ng + 2) * d, ...] -> (q [nh*d, ...], k [ng*d, ...], v [ng*d, ...])."""
    import torch

    ng = num_query_groups
    q_per_group = num_attention_heads // ng * head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(ng, q_per_group + 2 * head_dim, *tail)
    q, k, v = torch.split(grouped, [q_per_group, head_dim, head_dim], dim=1)
    return (
        q.reshape(-1, *tail).contiguous(),
        k.reshape(-1, *tail).contiguous(),
        v.reshape(-1, *tail).contiguous(),
    )


def fuse_gate_up(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Gated MLP: gate [F, H], up [F, H] -> megatron's global `linear_fc1` [2F, H] = cat(gate, up)."""
    import torch

    return torch.cat((gate, up), dim=0)


def split_gate_up(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `fuse_gate_up`: [2F, H] -> (gate [F, H], up [F, H])."""
    import torch

    gate, up = torch.chunk(fc1, 2, dim=0)
    return gate.contiguous(), up.contiguous()


def interleave_rotary_rows(weight: torch.Tensor, period: int, offset: int, width: int) -> torch.Tensor:
    """Rotate-half rotary rows -> pairwise-interleaved ones, in every group of `period` rows.

    weight: [G * period, ...]. In each group, rows `offset .. offset + width` hold rotary dims; rotate-half order
    (HF DeepSeek-V3 with `rope_interleave=False`) pairs dim i with dim i + width/2, megatron-core's multi-latent
    attention pairs dims 2i and 2i + 1: row i goes to 2i, row i + width/2 to 2i + 1. Other rows are unchanged.
    """
    import torch

    groups = weight.reshape(-1, period, *weight.shape[1:])
    rotary = groups[:, offset : offset + width]
    first, second = rotary.chunk(2, dim=1)
    paired = torch.stack((first, second), dim=2).reshape(rotary.shape)
    return torch.cat((groups[:, :offset], paired, groups[:, offset + width :]), dim=1).reshape(weight.shape)


def deinterleave_rotary_rows(weight: torch.Tensor, period: int, offset: int, width: int) -> torch.Tensor:
    """Inverse of `interleave_rotary_rows`: rows 2i go to i, rows 2i + 1 to i + width/2 (per group)."""
    import torch

    groups = weight.reshape(-1, period, *weight.shape[1:])
    rotary = groups[:, offset : offset + width]
    split = torch.cat((rotary[:, 0::2], rotary[:, 1::2]), dim=1)
    return torch.cat((groups[:, :offset], split, groups[:, offset + width :]), dim=1).reshape(weight.shape)


def pad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    """[V, H] -> [Vp, H] with zero rows appended (megatron pads the vocabulary for TP divisibility)."""
    import torch

    extra = padded_size - weight.shape[0]
    if extra < 0:
        raise ValueError(f"padded vocabulary {padded_size} is smaller than the vocabulary {weight.shape[0]}")
    if extra == 0:
        return weight
    return torch.cat((weight, weight.new_zeros(extra, *weight.shape[1:])), dim=0)


def unpad_vocab(weight: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[Vp, H] -> [V, H]: drop the padding rows."""
    return weight[:vocab_size].contiguous() if weight.shape[0] != vocab_size else weight


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's rule: round the vocabulary up to a multiple of `divisible_by * tp`."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def shard_boxes(shape: tuple[int, ...], parallel: Parallel, tp: int, parts: tuple[int, ...] = ()) -> list[Box]:
    """The chunks that `tp` ranks hold of a global tensor of `shape`, as megatron-core saves them.

    COLUMN and VOCAB split dim 0, ROW splits dim 1, GATED_COLUMN splits each half of dim 0 separately (each rank
    holds [gate_r; up_r]), REPLICATED keeps one chunk. COLUMN_PARTS (megatron-core's tensors of several parts, such
    as Gated DeltaNet's `in_proj`) splits each part of dim 0 separately, `parts` giving their row counts (each rank
    holds its rows of every part, part after part); without `parts` it is refused over more than one rank
    (ValueError). Boxes of several per rank come part by part, each part's in rank order.
    """
    zeros = (0,) * len(shape)
    if parallel is Parallel.COLUMN_PARTS and tp > 1:
        if not parts:
            raise ValueError("a tensor saved in parts is split part by part: its parts' rows are needed")
        if sum(parts) != shape[0]:
            raise ValueError(f"a tensor of parts {parts} has {sum(parts)} rows, not {shape[0]}")
        boxes, first = [], 0
        for rows in parts:
            boxes += _split_axis(shape, 0, tp, base=first, extent=rows)
            first += rows
        return boxes
    if parallel is Parallel.REPLICATED or (tp == 1 and parallel is not Parallel.GATED_COLUMN):
        return [(zeros, tuple(shape))]
    if parallel in (Parallel.COLUMN, Parallel.VOCAB):
        return _split_axis(shape, 0, tp, base=0, extent=shape[0])
    if parallel is Parallel.ROW:
        return _split_axis(shape, 1, tp, base=0, extent=shape[1])
    if parallel is Parallel.GATED_COLUMN:
        half = shape[0] // 2
        return _split_axis(shape, 0, tp, base=0, extent=half) + _split_axis(shape, 0, tp, base=half, extent=half)
    raise ValueError(f"unknown parallel style {parallel}")


def rank_boxes(
    shape: tuple[int, ...], parallel: Parallel, tp: int, rank: int, parts: tuple[int, ...] = ()
) -> list[Box]:
    """The chunks one tensor-parallel rank holds, in the order its local tensor stacks them (`parts`: as
    `shard_boxes`)."""
    boxes = shard_boxes(shape, parallel, tp, parts)
    if parallel is Parallel.GATED_COLUMN:  # [gate_r; up_r]
        return [boxes[rank], boxes[tp + rank]]
    if parallel is Parallel.COLUMN_PARTS and tp > 1:  # its rows of each part
        return [boxes[part * tp + rank] for part in range(len(parts))]
    return [boxes[0] if len(boxes) == 1 else boxes[rank]]


def rank_shard(full: torch.Tensor, parallel: Parallel, tp: int, rank: int, parts: tuple[int, ...] = ()) -> torch.Tensor:
    """The local tensor of one tensor-parallel rank (a copy)."""
    import torch

    boxes = rank_boxes(tuple(full.shape), parallel, tp, rank, parts)
    return torch.cat([take_box(full, box) for box in boxes])


SPLIT_AXIS = {
    Parallel.COLUMN: 0,
    Parallel.VOCAB: 0,
    Parallel.GATED_COLUMN: 0,
    Parallel.COLUMN_PARTS: 0,
    Parallel.ROW: 1,
}
"""The dimension each parallel style splits (replicated tensors split none)."""


def global_shape(local: tuple[int, ...], parallel: Parallel, tp: int) -> tuple[int, ...]:
    """The whole tensor's shape, from one rank's local shape."""
    axis = SPLIT_AXIS.get(parallel)
    if axis is None:
        return local
    return tuple(size * tp if dim == axis else size for dim, size in enumerate(local))


def merge_rank_shards(shards: list[torch.Tensor], parallel: Parallel, parts: tuple[int, ...] = ()) -> torch.Tensor:
    """Inverse of `rank_shard`: the whole tensor (a new one) from every rank's local tensor, in rank order."""
    import torch

    axis = SPLIT_AXIS.get(parallel)
    if axis is None:
        return shards[0].clone()
    shape = global_shape(tuple(shards[0].shape), parallel, len(shards))
    out = torch.empty(shape, dtype=shards[0].dtype)
    for rank, shard in enumerate(shards):
        start = 0
        for box in rank_boxes(shape, parallel, len(shards), rank, parts):
            size = box[1][axis]
            out[tuple(slice(o, o + s) for o, s in zip(*box, strict=True))] = shard.narrow(axis, start, size)
            start += size
    return out


def _split_axis(shape: tuple[int, ...], axis: int, parts: int, *, base: int, extent: int) -> list[Box]:
    if extent % parts:
        raise ValueError(f"dimension {axis} of size {extent} does not split into {parts} parts")
    step = extent // parts
    boxes = []
    for r in range(parts):
        offsets = [0] * len(shape)
        sizes = list(shape)
        offsets[axis] = base + r * step
        sizes[axis] = step
        boxes.append((tuple(offsets), tuple(sizes)))
    return boxes


def take_box(tensor: torch.Tensor, box: Box) -> torch.Tensor:
    """The chunk of `tensor` described by `box` (a view)."""
    offsets, sizes = box
    index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes, strict=True))
    return tensor[index]
