"""What rank `r` of an engine sharded over `t` tensor-parallel ranks must hold of each HF tensor a refit streams,
worked out on the trainer's side: the reference the refit's transfer check compares the engine's tensors with.

The engine slices the tensors it is given itself (`engine.tp_shards`); a check whose "sent" side came from that same
slicing would pass a wrong head split or a KV head on the wrong rank on both sides. So this module never imports
the engine: each HF name's role comes from the mapping table (the entry that names it and its parallel style,
`models.parallel_style.Parallel`, through `model_plan.placed_entries`), the chunking from conversion's
description of how megatron-core splits a tensor over TP ranks (`models.tensor_ops.rank_boxes`), and the
attention heads from the model config (HF's grouped-query rule: query head `h` reads KV head
`h // (heads / kv_heads)`). What is cut from a full tensor is a view (`narrow`): no copy.

What rank `r` of `t` holds, as assumed here (megatron-core's tensor parallelism in HF terms):
- `q_proj` (weight and bias): the r-th of t equal blocks of query heads (the heads must divide by t);
- `k_proj`, `v_proj`: the KV heads the rank's query heads read. With the KV heads divisible by t that is the
  r-th of t equal blocks of query groups, megatron-core's split of its fused `linear_qkv`; with fewer KV heads than
  ranks (t a multiple of them) it is one KV head, replicated on every rank whose query heads read it (vLLM's rule;
  megatron-core refuses that case, so only a full-tensor refit meets it). Any other ratio is refused;
- a gated MLP's gate and up (dense, shared expert, every routed expert): megatron-core's `GATED_COLUMN` chunks of
  `cat(gate, up)`, i.e. the r-th of t row blocks of gate and of up;
- `ROW` tensors (`o_proj`, every `down_proj`): the r-th of t blocks of input columns; `COLUMN` ones the r-th of t
  blocks of rows;
- `VOCAB` tensors (embedding, output layer): the vocabulary padded to a multiple of t (not megatron-core's
  `make_vocab_size_divisible_by * t`: the engine splits the vocabulary itself), split into t blocks of rows, the
  padding left out, so the last rank(s) may hold fewer rows;
- `REPLICATED` tensors (norms, q/k norms, router, expert score bias, shared-expert gate): whole;
- routed experts: every rank holds every expert (expert tensor parallelism over the engine's whole group; the
  engine has no expert parallelism);
- gated attention (Qwen3-Next, Qwen3.5): `q_proj` holds per query head its query rows then its output gate's, so
  the r-th of t blocks of query heads is twice the rows of a plain query's;
- Gated DeltaNet (`engine.gated_delta`'s split, by key heads with the value heads each serves): `in_proj_qkv` and
  `conv1d` the r-th of t blocks of each of their q, k and v sections (megatron-core splits them part by part too);
  `in_proj_z`, `in_proj_b`, `in_proj_a`, `dt_bias`, `A_log` and Qwen3-Next's per-key-head fused `in_proj_qkvz`,
  `in_proj_ba` the r-th of t blocks of rows; `out_proj` as `ROW`; the gated norm whole;
- multi-latent attention (vLLM's split): the down-projections (`q_a_proj`, `kv_a_proj_with_mqa`) and the latent
  norms whole on every rank (each rank's heads read the whole latent, and the cache holds it whole on each rank);
  the per-head up-projections (`q_b_proj` or `q_proj`, `kv_b_proj`) the r-th of t blocks of rows (whole heads);
  `o_proj` as `ROW`;
- LoRA adapters the engine applies itself (`engine.lora`, PEFT's `<module>.lora_A.weight` / `.lora_B.weight`):
  A whole, B cut as its weight's rows, for a column-parallel projection; A cut as its weight's columns, B whole,
  for a row-parallel one. They are streamed whole in every refit, also a shard-local one;
- a name the table does not list: whole (if the engine keeps a part of it, the check fails rather than passes).

Streams: a full-tensor refit (`bridge.export.export_hf_weights`, or a DTensor policy's) is cut as above; in a
shard-local refit (`refit.stream.shard_local_hf_weights`: engine TP = trainer TP, the same ranks in the same order)
each tensor is already the trainer's own megatron-core shard in HF terms, which is itself the reference
(`trainer_part=True`), except the vocabulary tensors, which come whole and are cut. At t = 1 every tensor is its own
reference. A cut is a view of the full tensor, except Gated DeltaNet's sections (three blocks joined: a copy).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from hf_mcore_bridge.convert.model_plan import placed_entries
from hf_mcore_bridge.models.mapping_types import (
    Direct,
    FusedGateUp,
    FusedQKV,
    GatedQKV,
    GroupedLinearInProj,
    LinearInProj,
    Size,
    keeps_float32,
)
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.spec import ModelSpec
from hf_mcore_bridge.models.tensor_ops import padded_vocab_size, rank_boxes

__all__ = ["ADAPTER_A", "ADAPTER_B", "EnginePartReference", "Role", "roles"]

ADAPTER_A, ADAPTER_B = ".lora_A.weight", ".lora_B.weight"
"""Suffixes of a LoRA adapter's streamed tensors (PEFT's names), after its HF module's name."""


class Role(enum.Enum):
    """How an HF tensor is split over the engine's tensor-parallel ranks."""

    WHOLE = "whole"
    QUERY = "query heads"
    GATED_QUERY = "query heads, each with its output gate's rows"
    SECTIONS = "rows of each of the q, k and v sections"
    KEY_VALUE = "key/value heads"
    GATE = "gate half of a gated column"
    UP = "up half of a gated column"
    ROW = "input columns"
    COLUMN = "output rows"
    VOCAB = "vocabulary rows"


LATENT_DOWN_ROWS = (Size.Q_LORA, Size.KV_DOWN)
"""Output rows of multi-latent attention's down-projections, which every engine rank holds whole."""

_DIRECT = {
    Parallel.REPLICATED: Role.WHOLE,
    Parallel.ROW: Role.ROW,
    Parallel.COLUMN: Role.COLUMN,
    Parallel.VOCAB: Role.VOCAB,
    Parallel.COLUMN_PARTS: Role.SECTIONS,
}


def roles(model_cfg: ModelSpec) -> tuple[dict[str, Role], frozenset[str]]:
    """(HF name -> role, the names the table keeps in float32) for every tensor of the model's mapping table, every
    layer and expert filled in."""
    found: dict[str, Role] = {}
    float32: set[str] = set()
    for placed in placed_entries(model_cfg):
        entry = placed.entry
        if isinstance(entry, FusedQKV):
            found.update({entry.q: Role.QUERY, entry.k: Role.KEY_VALUE, entry.v: Role.KEY_VALUE})
        elif isinstance(entry, FusedGateUp):
            found.update({entry.gate: Role.GATE, entry.up: Role.UP})
        elif isinstance(entry, GatedQKV):
            found.update({entry.q: Role.GATED_QUERY, entry.k: Role.KEY_VALUE, entry.v: Role.KEY_VALUE})
        elif isinstance(entry, LinearInProj):
            found.update({entry.qkv: Role.SECTIONS, entry.z: Role.COLUMN, entry.b: Role.COLUMN, entry.a: Role.COLUMN})
        elif isinstance(entry, GroupedLinearInProj):
            found.update({entry.qkvz: Role.COLUMN, entry.ba: Role.COLUMN})
        elif isinstance(entry, Direct):
            latent_down = entry.parallel is Parallel.COLUMN and entry.shape[0] in LATENT_DOWN_ROWS
            found[entry.hf] = Role.WHOLE if latent_down else _DIRECT[entry.parallel]
            if keeps_float32(entry):
                float32.add(entry.hf)
        else:  # multi-latent attention's projections with rotary rows: per head (the query's), or the shared latent
            found.update(dict.fromkeys(entry.hf_sources, Role.COLUMN if entry.per_head else Role.WHOLE))
    return found, frozenset(float32)


@dataclass(frozen=True)
class _Cut:
    """`size` entries from `start` along `dim` of the full tensor."""

    dim: int
    start: int
    size: int


class EnginePartReference:
    """The part of each streamed HF tensor that rank `rank` of an engine of `size` tensor-parallel ranks must hold
    (see the module docstring), and the dtype the engine holds it in. Built once per run; `part` is a view."""

    def __init__(self, model_cfg: ModelSpec, size: int, rank: int) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"engine tensor-parallel rank {rank} of {size} is out of range")
        heads, groups = model_cfg.num_attention_heads, model_cfg.num_query_groups
        if size > 1:
            if heads % size:
                raise ValueError(f"num_attention_heads ({heads}) does not divide by the engine's TP size {size}")
            if groups % size and size % groups:
                raise ValueError(f"num_key_value_heads ({groups}) neither divides by nor divides engine TP {size}")
        self.size, self.rank = size, rank
        self.heads, self.groups, self.head_dim = heads, groups, model_cfg.head_dim
        self.roles, self.float32 = roles(model_cfg)
        linear = model_cfg.linear_attention
        self.sections = (linear.key_dim, linear.key_dim, linear.value_dim) if linear is not None else ()
        """Gated DeltaNet's q, k and v rows (in `in_proj_qkv` and `conv1d`)."""

    def part(self, name: str, tensor: torch.Tensor, trainer_part: bool = False) -> torch.Tensor:
        """This rank's part of the streamed `tensor` of HF name `name`: cut from the full tensor, or, with
        `trainer_part` (a shard-local refit), the tensor as streamed unless it is a vocabulary tensor (those come
        whole). ValueError: a tensor that is not full where it is cut."""
        if self.size == 1:
            return tensor
        role = self._adapter_role(name)
        if role is not None:
            trainer_part = False  # adapters are streamed whole
        else:
            role = self.roles.get(name, Role.WHOLE)
        if role is Role.WHOLE or (trainer_part and role is not Role.VOCAB):
            return tensor
        if role is Role.SECTIONS:
            if not self.sections or tensor.shape[0] != sum(self.sections):
                raise ValueError(
                    f"{name}: expected the full tensor, {sum(self.sections)} rows, got {tuple(tensor.shape)}"
                )
            return torch.cat([section.chunk(self.size)[self.rank] for section in tensor.split(self.sections)])
        cut = self._cut(name, role, tuple(tensor.shape))
        return tensor.narrow(cut.dim, cut.start, cut.size)

    def _adapter_role(self, name: str) -> Role | None:
        """The role of a LoRA adapter's A or B from its weight's (see the module docstring); None for other names."""
        for suffix, factor in ((ADAPTER_A, "A"), (ADAPTER_B, "B")):
            if name.endswith(suffix):
                weight = self.roles.get(name.removesuffix(suffix) + ".weight", Role.WHOLE)
                if weight is Role.ROW:
                    return Role.ROW if factor == "A" else Role.WHOLE
                return Role.WHOLE if factor == "A" else weight
        return None

    def dtype(self, name: str, default: torch.dtype) -> torch.dtype:
        """The dtype the engine holds `name` in: float32 where the table keeps it so, else `default` (the policy's)."""
        return torch.float32 if name in self.float32 else default

    def _cut(self, name: str, role: Role, shape: tuple[int, ...]) -> _Cut:
        if role in (Role.QUERY, Role.GATED_QUERY, Role.KEY_VALUE):
            return self._attention_cut(name, role, shape)
        if role in (Role.GATE, Role.UP):
            half = shape[0]
            gate_box, up_box = rank_boxes((2 * half, *shape[1:]), Parallel.GATED_COLUMN, self.size, self.rank)
            offsets, sizes = gate_box if role is Role.GATE else up_box
            return _Cut(0, offsets[0] - (half if role is Role.UP else 0), sizes[0])
        if role is Role.VOCAB:
            vocab = shape[0]
            padded = (padded_vocab_size(vocab, 1, self.size), *shape[1:])
            ((offsets, sizes),) = rank_boxes(padded, Parallel.VOCAB, self.size, self.rank)
            return _Cut(0, offsets[0], max(0, min(sizes[0], vocab - offsets[0])))
        if role in (Role.ROW, Role.COLUMN):
            dim = 1 if role is Role.ROW else 0
            if len(shape) <= dim:
                raise ValueError(f"{name}: a {role.value} split needs dim {dim}, got shape {shape}")
            ((offsets, sizes),) = rank_boxes(shape, _PARALLEL[role], self.size, self.rank)
            return _Cut(dim, offsets[dim], sizes[dim])
        raise ValueError(f"{name}: no tensor-parallel reference for {role.value}")

    def _attention_cut(self, name: str, role: Role, shape: tuple[int, ...]) -> _Cut:
        """The rank's query heads (an equal block; a gated query's heads hold their gate's rows after their own), or
        the KV heads those heads read."""
        d = 2 * self.head_dim if role is Role.GATED_QUERY else self.head_dim
        count = self.groups if role is Role.KEY_VALUE else self.heads
        if not shape or shape[0] != count * d:
            raise ValueError(f"{name}: expected the full tensor, {count} heads of {d} rows, got shape {shape}")
        ((first,), (held,)) = rank_boxes((self.heads,), Parallel.COLUMN, self.size, self.rank)[0]
        if role is not Role.KEY_VALUE:
            return _Cut(0, first * d, held * d)
        per_group = self.heads // self.groups
        first_group, last_group = first // per_group, (first + held - 1) // per_group
        return _Cut(0, first_group * d, (last_group - first_group + 1) * d)


_PARALLEL: Mapping[Role, Parallel] = {Role.ROW: Parallel.ROW, Role.COLUMN: Parallel.COLUMN}
