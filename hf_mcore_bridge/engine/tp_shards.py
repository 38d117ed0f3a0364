"""Which part of each full HF tensor one tensor-parallel rank of the engine keeps. Pure functions, no groups.

The engine shards like megatron-core's column- and row-parallel layers (`parallel_style.Parallel`): q heads and
KV heads split over the ranks (column), the gate and up projections each split by columns, o_proj and down_proj
by their input columns (row), every routed expert's gate/up/down the same way (expert tensor parallelism: each
rank a slice of every expert's width), and the vocabulary of the embedding and output layer by rows.

Assumptions: the query heads and every MLP / expert width divide by the TP size. KV heads either divide by it, or
(fewer KV heads than ranks) the TP size is a multiple of them and each KV head is replicated on the
`tp / num_kv_heads` ranks whose query heads read it (as vLLM does; megatron-core refuses that case). The vocabulary
need not divide: each rank holds `ceil(vocab / tp)` rows, the last ones padding that is never read (embedding
lookups of other ranks' ids are masked, padded logits are cut off after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TPRank:
    """One rank's place in the tensor-parallel group."""

    size: int
    rank: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"tensor-parallel rank {self.rank} of {self.size} is out of range")


@dataclass(frozen=True)
class Shard:
    """A rank's part of a full tensor: `size` entries from `start` along `dim`, whose full extent is `full`."""

    dim: int
    start: int
    size: int
    full: int

    def take(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The rank's part of the full `tensor` (a view); `ValueError` if `tensor` is not full along `dim`."""
        if tensor.dim() <= self.dim or tensor.shape[self.dim] != self.full:
            raise ValueError(
                f"{name}: expected the full tensor, {self.full} along dim {self.dim}, got shape {tuple(tensor.shape)}"
            )
        return tensor.narrow(self.dim, self.start, self.size)

    def full_shape(self, part: tuple[int, ...]) -> tuple[int, ...]:
        """The full tensor's shape, from the shape of a rank's part."""
        return tuple(self.full if dim == self.dim else size for dim, size in enumerate(part))


@dataclass(frozen=True)
class Sections:
    """A rank's part of a full tensor made of several pieces along one dim, concatenated in order: its share of each
    section of a tensor whose sections are split over the ranks one by one (Gated DeltaNet's q, k and v rows of
    `in_proj_qkv` and of its conv's channels: `gated_delta.linear_attn_shards`)."""

    pieces: tuple[Shard, ...]

    def take(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """The rank's part of the full `tensor` (a copy); `ValueError` if `tensor` is not full along the dim."""
        return torch.cat([piece.take(tensor, name) for piece in self.pieces], dim=self.pieces[0].dim)

    def full_shape(self, part: tuple[int, ...]) -> tuple[int, ...]:
        return self.pieces[0].full_shape(part)


def even_split(extent: int, tp: TPRank, what: str) -> tuple[int, int]:
    """(start, size) of the rank's equal part of `extent`; `ValueError` naming `what` if it does not divide."""
    if extent % tp.size:
        raise ValueError(f"{what} ({extent}) does not divide by the tensor-parallel size {tp.size}")
    size = extent // tp.size
    return tp.rank * size, size


def kv_heads(num_kv_heads: int, tp: TPRank) -> tuple[int, int]:
    """(first KV head, KV heads) of the rank: an equal split, or one replicated head when KV heads < TP size."""
    if num_kv_heads % tp.size == 0:
        return even_split(num_kv_heads, tp, "num_key_value_heads")
    if tp.size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) must divide by the tensor-parallel size {tp.size} or divide it"
        )
    # rank r's query heads all belong to KV group floor(r * kv / tp): that head, replicated over tp / kv ranks
    return tp.rank * num_kv_heads // tp.size, 1


def vocab_rows(vocab_size: int, tp: TPRank) -> tuple[int, int, int]:
    """(first row, rows held, rows allocated) of the rank's vocabulary block: every rank allocates
    `ceil(vocab / tp)` rows; the last rank(s) hold fewer real ones."""
    per_rank = -(-vocab_size // tp.size)
    start = tp.rank * per_rank
    return start, max(0, min(per_rank, vocab_size - start)), per_rank


@dataclass(frozen=True)
class LocalSizes:
    """The per-rank widths the engine's modules are built with."""

    num_heads: int
    num_kv_heads: int
    first_kv_head: int
    intermediate_size: int
    expert_width: int | None
    shared_expert_width: int | None
    vocab_start: int
    vocab_held: int
    vocab_rows: int


def local_sizes(
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    expert_width: int | None,
    shared_expert_width: int | None,
    vocab_size: int,
    tp: TPRank,
) -> LocalSizes:
    """The rank's widths (validated: `ValueError` naming the first width that does not split)."""
    _, heads = even_split(num_heads, tp, "num_attention_heads")
    first_kv, kv = kv_heads(num_kv_heads, tp)
    _, width = even_split(intermediate_size, tp, "intermediate_size")
    experts = None if expert_width is None else even_split(expert_width, tp, "the expert width")[1]
    shared = None if shared_expert_width is None else even_split(shared_expert_width, tp, "the shared expert width")[1]
    start, held, rows = vocab_rows(vocab_size, tp)
    return LocalSizes(heads, kv, first_kv, width, experts, shared, start, held, rows)


def head_shard(num_heads: int, head_dim: int, tp: TPRank, dim: int = 0) -> Shard:
    """The rank's q heads of a q projection ([heads * d, H] on dim 0) or of o_proj's input (dim 1)."""
    start, size = even_split(num_heads, tp, "num_attention_heads")
    return Shard(dim, start * head_dim, size * head_dim, num_heads * head_dim)


def kv_shard(num_kv_heads: int, head_dim: int, tp: TPRank) -> Shard:
    """The rank's KV heads of a k or v projection ([kv_heads * d, H] or its bias)."""
    first, count = kv_heads(num_kv_heads, tp)
    return Shard(0, first * head_dim, count * head_dim, num_kv_heads * head_dim)


def column_shard(width: int, tp: TPRank, what: str) -> Shard:
    """The rank's output rows of a column-parallel projection (gate or up: [width, H])."""
    start, size = even_split(width, tp, what)
    return Shard(0, start, size, width)


def row_shard(width: int, tp: TPRank, what: str) -> Shard:
    """The rank's input columns of a row-parallel projection (down: [H, width])."""
    start, size = even_split(width, tp, what)
    return Shard(1, start, size, width)


def vocab_shard(vocab_size: int, tp: TPRank) -> Shard:
    """The rank's rows of the embedding or output layer ([vocab, H])."""
    start, held, _ = vocab_rows(vocab_size, tp)
    return Shard(0, start, held, vocab_size)
