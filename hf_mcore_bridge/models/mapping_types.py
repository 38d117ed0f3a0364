"""The vocabulary that architecture mapping tables are written in.

A table is a tuple of entries. Each entry names one megatron-core tensor (its distributed-checkpoint key, with a
`{layer}` placeholder for decoder layers), the HF tensor(s) it is made of, and its tensor-parallel style. The
entry knows how to go both ways (HF -> megatron and back), so a table is written once and drives conversion,
export and refit alike. Each entry also states the HF tensors' full shapes in model dimensions (`Size`), so every
tensor can be checked against the config before anything is written, in either direction, and its row layout
(`hf_rows`, `mcore_rows`: which rows of its inputs each output row is), so the rows a conversion copies unchanged
are planned without torch; the tests check each layout against the entry's own transform. Importing this module
does not import torch: the transforms (`tensor_ops`) import it when one runs.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from hf_mcore_bridge.checkpoint.names import EXPERT, LAYER, fill
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.row_runs import MCORE, RowRun, merged
from hf_mcore_bridge.models.tensor_ops import (
    deinterleave_rotary_rows,
    fuse_gate_up,
    fuse_qkv,
    interleave_rotary_rows,
    pad_vocab,
    split_gate_up,
    split_qkv,
    unpad_vocab,
)

if TYPE_CHECKING:
    import torch


FULL_ATTENTION = "full_attention"
"""The `layer_types` entry of a layer attending to every earlier position."""
LINEAR_ATTENTION = "linear_attention"
"""The `layer_types` entry of a Gated DeltaNet (linear attention) layer."""


class LayerKind(enum.Enum):
    """The kinds of decoder layer a table entry appears in."""

    ALL = "all"
    DENSE = "dense"
    """Layers with a dense MLP (all layers of a dense model; `mlp_only_layers` of a MoE model)."""
    MOE = "moe"
    """Layers with a routed mixture of experts."""
    MTP = "mtp"
    """Multi-token-prediction layers (megatron-core's `mtp.layers.{i}`, HF's layers after the decoder's): `{layer}`
    is the MTP layer's index in megatron-core names and its HF layer index in HF names."""


class Feature(enum.Enum):
    """An optional part of a model that its HF config switches on or off (`Architecture.qk_norm` / `qkv_bias` name
    the switch; `q_lora_rank` the query's form under multi-latent attention); an entry that `requires` one is
    present only in models that have it (`ModelSpec.has`)."""

    QK_NORM = "q/k norm"
    """RMSNorm on each head of q and k (megatron `qk_layernorm`)."""
    QKV_BIAS = "q/k/v bias"
    """Biases on the q, k and v projections (megatron `add_qkv_bias`)."""
    O_BIAS = "output projection bias"
    """A bias on the attention's output projection (megatron-core's `linear_proj.bias`, with `add_bias_linear`)."""
    Q_LORA = "low-rank query"
    """Multi-latent attention with a low-rank query (`q_lora_rank` set): query down/up projections and norm."""
    FULL_RANK_Q = "full-rank query"
    """Multi-latent attention without one (`q_lora_rank` null, Moonlight): one query projection."""


class Size(enum.Enum):
    """A model dimension that HF tensor shapes are written in; resolved from the model config when checking."""

    HIDDEN = "hidden"
    Q = "query heads * head_dim"
    KV = "key/value heads * head_dim"
    HEAD_DIM = "head_dim"
    HEADS = "query heads"
    FFN = "dense MLP width"
    EXPERT_FFN = "routed expert MLP width"
    SHARED_FFN = "shared expert MLP width"
    VOCAB = "vocabulary"
    EXPERTS = "routed experts"
    ONE = "1"
    TWO_HIDDEN = "2 * hidden"
    MLA_Q = "query heads * (qk_nope_head_dim + qk_rope_head_dim)"
    Q_LORA = "q_lora_rank"
    KV_LORA = "kv_lora_rank"
    KV_DOWN = "kv_lora_rank + qk_rope_head_dim"
    KV_UP = "query heads * (qk_nope_head_dim + v_head_dim)"
    MLA_V = "query heads * v_head_dim"
    Q_GATED = "2 * query heads * head_dim"
    """A query projection that also holds the output gate (Qwen3-Next's and Qwen3.5's full attention)."""
    LINEAR_QKV = "2 * linear key heads * linear key head dim + linear value heads * linear value head dim"
    LINEAR_QKVZ = "2 * linear key dims + 2 * linear value dims"
    LINEAR_V = "linear value heads * linear value head dim"
    LINEAR_HEADS = "linear value heads"
    LINEAR_V_HEAD = "linear value head dim"
    LINEAR_BA = "2 * linear value heads"
    CONV_KERNEL = "linear_conv_kernel_dim"


Shape = tuple[Size, ...]


@dataclass(frozen=True)
class Dims:
    """The model dimensions that fused-tensor transforms need."""

    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    padded_vocab_size: int
    qk_nope_head_dim: int = 0
    """Multi-latent attention: the query/key dims without rotary embedding (0 without MLA)."""
    qk_rope_head_dim: int = 0
    """Multi-latent attention: the rotary query/key dims."""
    kv_lora_rank: int = 0
    """Multi-latent attention: the width of the compressed key/value latent."""
    rotate_half_rotary: bool = False
    """The HF weights hold the rotary dims in rotate-half order (DeepSeek-V3's `rope_interleave=false`) rather
    than megatron-core MLA's pairwise-interleaved order."""
    linear_key_heads: int = 0
    """Gated DeltaNet: query/key heads (0 without linear attention)."""
    linear_value_heads: int = 0
    """Gated DeltaNet: value heads (a multiple of the key heads)."""
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0

    def linear_parts(self) -> dict[str, int]:
        """Gated DeltaNet's `in_proj` rows, part by part, in megatron-core's order (`query`, `key`, `value`, `z`,
        `beta`, `alpha`)."""
        keys = self.linear_key_heads * self.linear_key_head_dim
        values = self.linear_value_heads * self.linear_value_head_dim
        heads = self.linear_value_heads
        return {"query": keys, "key": keys, "value": values, "z": values, "beta": heads, "alpha": heads}


@dataclass(frozen=True)
class Direct:
    """One HF tensor is one megatron-core tensor (possibly with vocabulary padding)."""

    mcore: str
    hf: str
    parallel: Parallel
    shape: Shape
    """The HF tensor's full shape."""
    untied_only: bool = False
    """Present only when the output layer is not tied to the word embeddings."""
    layers: LayerKind = LayerKind.ALL
    """Which decoder layers have this tensor (dense-MLP or MoE layers, or all)."""
    requires: Feature | None = None
    """Present only in models with this optional feature (None: always)."""
    float32: bool = False
    """Held in float32 whatever the model's dtype, on both sides (the router's expert score bias: transformers keeps
    `e_score_correction_bias` in float32, megatron-core its `expert_bias`); left out of the mixed-dtype check."""
    attention: str | None = None
    """Present only in decoder layers of this `layer_types` kind (`full_attention`, `linear_attention`); None:
    in every layer."""

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_expected(self) -> dict[str, Shape]:
        """The full shape of each HF tensor, in model dimensions."""
        return {self.hf: self.shape}

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        shape = shapes[self.hf]
        if self.parallel is not Parallel.VOCAB:
            return shape
        _expect(self.hf, shape[0], dims.vocab_size, "vocab_size")
        return (dims.padded_vocab_size, *shape[1:])

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        if self.parallel is Parallel.VOCAB:
            return {self.hf: (dims.vocab_size, *shape[1:])}
        return {self.hf: shape}

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """The HF tensor's rows as runs of the megatron-core tensor's (of `shape`): all of them, or the first
        `vocab_size` (the padding dropped)."""
        rows = min(shape[0], dims.vocab_size) if self.parallel is Parallel.VOCAB else shape[0]
        return {self.hf: merged([(MCORE, 0, rows)])}

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """The megatron-core tensor's rows as runs of the HF tensor's: all of them, then zero rows up to
        `padded_vocab_size` for a vocabulary tensor. ValueError: a padded vocabulary smaller than the tensor."""
        rows = shapes[self.hf][0]
        padding = dims.padded_vocab_size - rows if self.parallel is Parallel.VOCAB else 0
        if padding < 0:
            raise ValueError(f"padded vocabulary {dims.padded_vocab_size} is smaller than {self.hf}'s {rows} rows")
        return merged([(self.hf, 0, rows), (None, 0, padding)])

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        tensor = tensors[self.hf]
        if self.parallel is Parallel.VOCAB:
            return pad_vocab(tensor, dims.padded_vocab_size)
        return tensor

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        if self.parallel is Parallel.VOCAB:
            tensor = unpad_vocab(tensor, dims.vocab_size)
        return {self.hf: tensor}


@dataclass(frozen=True)
class FusedQKV:
    """HF's q/k/v projections fused into megatron's `linear_qkv`, interleaved per query group."""

    mcore: str
    q: str
    k: str
    v: str
    parallel: Parallel = Parallel.COLUMN
    tail: Shape = (Size.HIDDEN,)
    """The dimensions after the output rows: the input width for weights, none for biases."""
    untied_only: bool = False
    layers: LayerKind = LayerKind.ALL
    requires: Feature | None = None

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def hf_expected(self) -> dict[str, Shape]:
        return {self.q: (Size.Q, *self.tail), self.k: (Size.KV, *self.tail), self.v: (Size.KV, *self.tail)}

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        q, k, v = shapes[self.q], shapes[self.k], shapes[self.v]
        _expect(self.q, q[0], dims.num_attention_heads * dims.head_dim, "num_attention_heads * head_dim")
        _expect(self.k, k[0], dims.num_query_groups * dims.head_dim, "num_key_value_heads * head_dim")
        _expect(self.v, v[0], dims.num_query_groups * dims.head_dim, "num_key_value_heads * head_dim")
        return (q[0] + k[0] + v[0], *q[1:])

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        groups = dims.num_query_groups * dims.head_dim
        _expect(self.mcore, shape[0], dims.num_attention_heads * dims.head_dim + 2 * groups, "q + k + v rows")
        tail = shape[1:]
        return {
            self.q: (dims.num_attention_heads * dims.head_dim, *tail),
            self.k: (groups, *tail),
            self.v: (groups, *tail),
        }

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """q, k and v's rows as runs of the fused tensor's (of `shape`), which holds per query group its
        `num_attention_heads / num_query_groups` q heads, then its k head, then its v head (`tensor_ops.split_qkv`).
        ValueError: a row count that is not `num_query_groups` such groups."""
        groups, head = dims.num_query_groups, dims.head_dim
        q_rows = dims.num_attention_heads // groups * head
        period = q_rows + 2 * head
        if shape[0] != groups * period:
            raise ValueError(f"{self.mcore} has {shape[0]} rows, not {groups} query groups of {period}")
        firsts = [g * period for g in range(groups)]
        return {
            self.q: merged((MCORE, first, q_rows) for first in firsts),
            self.k: merged((MCORE, first + q_rows, head) for first in firsts),
            self.v: merged((MCORE, first + q_rows + head, head) for first in firsts),
        }

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """The fused tensor's rows as runs of q's, k's and v's: per query group, its share of q's rows, then of
        k's, then of v's (`tensor_ops.fuse_qkv`). ValueError: a row count that does not split into the groups."""
        groups = dims.num_query_groups
        names = self.hf_sources
        rows = [shapes[name][0] for name in names]
        if groups <= 0 or any(count % groups for count in rows):
            raise ValueError(f"q/k/v rows {rows} do not split into {groups} query groups")
        shares = [count // groups for count in rows]
        return merged(
            (name, g * share, share) for g in range(groups) for name, share in zip(names, shares, strict=True)
        )

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        return fuse_qkv(tensors[self.q], tensors[self.k], tensors[self.v], dims.num_query_groups)

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        q, k, v = split_qkv(tensor, dims.num_attention_heads, dims.num_query_groups, dims.head_dim)
        return {self.q: q, self.k: k, self.v: v}


@dataclass(frozen=True)
class FusedGateUp:
    """A gated MLP's gate and up projections fused into megatron's `linear_fc1` as `cat(gate, up)`."""

    mcore: str
    gate: str
    up: str
    parallel: Parallel = Parallel.GATED_COLUMN
    width: Size = Size.FFN
    """The MLP width (rows of gate and of up): dense, routed expert or shared expert."""
    untied_only: bool = False
    layers: LayerKind = LayerKind.ALL
    requires: Feature | None = None
    bias: bool = False
    """`linear_fc1`'s bias `cat(gate_bias, up_bias)`, of shape (2 * width,) (GPT-OSS's biased experts)."""

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.gate, self.up)

    def hf_expected(self) -> dict[str, Shape]:
        shape = (self.width,) if self.bias else (self.width, Size.HIDDEN)
        return {self.gate: shape, self.up: shape}

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        gate, up = shapes[self.gate], shapes[self.up]
        if gate != up:
            raise CheckpointError(f"{self.gate} has shape {gate} but {self.up} has shape {up}")
        return (2 * gate[0], *gate[1:])

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        half = (shape[0] // 2, *shape[1:])
        return {self.gate: half, self.up: half}

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """gate's rows are the first half of the fused tensor's (of `shape`), up's the second. ValueError: an odd
        row count."""
        if shape[0] % 2:
            raise ValueError(f"{self.mcore} has {shape[0]} rows, not two equal halves")
        half = shape[0] // 2
        return {self.gate: merged([(MCORE, 0, half)]), self.up: merged([(MCORE, half, half)])}

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """The fused tensor's rows: gate's, then up's."""
        return merged([(self.gate, 0, shapes[self.gate][0]), (self.up, 0, shapes[self.up][0])])

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        return fuse_gate_up(tensors[self.gate], tensors[self.up])

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        gate, up = split_gate_up(tensor)
        return {self.gate: gate, self.up: up}


@dataclass(frozen=True)
class RotaryRows:
    """A multi-latent-attention projection whose output rows include rotary dims: the query projection (per head:
    `qk_nope_head_dim` plain rows, then `qk_rope_head_dim` rotary ones) or the key/value down-projection (the
    `kv_lora_rank` latent rows, then the shared rotary key's).

    megatron-core's MLA rotary pairs dims 2i and 2i + 1, as DeepSeek's own weights do (HF `rope_interleave=true`):
    the tensor is then copied as it is. Weights in rotate-half order (`rope_interleave=false`) have their rotary
    rows interleaved on import and put back on export (`tensor_ops.interleave_rotary_rows`), so both layouts give
    the same attention scores."""

    mcore: str
    hf: str
    shape: Shape
    """The HF tensor's full shape."""
    per_head: bool
    """Rotary rows in every head (the query) or once (the key/value down-projection)."""
    parallel: Parallel = Parallel.COLUMN
    untied_only: bool = False
    layers: LayerKind = LayerKind.ALL
    requires: Feature | None = None

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.hf,)

    def hf_expected(self) -> dict[str, Shape]:
        return {self.hf: self.shape}

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        return shapes[self.hf]

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        return {self.hf: shape}

    def _rows(self, dims: Dims) -> tuple[int, int, int]:
        """(period, offset, width) of the rotary rows."""
        rope = dims.qk_rope_head_dim
        plain = dims.qk_nope_head_dim if self.per_head else dims.kv_lora_rank
        return plain + rope, plain, rope

    def _order(self, rows: int, dims: Dims) -> list[tuple[int, int]] | None:
        """Rotate-half rows -> pairwise-interleaved ones as segments (first HF row, count) in megatron-core's row
        order (`tensor_ops.interleave_rotary_rows`); None when the rows are kept as they are. ValueError: a row
        count that is not whole groups, or an odd rotary width."""
        if not dims.rotate_half_rotary:
            return None
        period, offset, width = self._rows(dims)
        if period <= 0 or rows % period or width % 2:
            raise ValueError(f"{self.mcore}'s {rows} rows are not whole groups of {period} with even rotary dims")
        half = width // 2
        order = []
        for first in range(0, rows, period):
            rotary = first + offset
            order.append((first, offset))
            order += [(rotary + i + pair * half, 1) for i in range(half) for pair in (0, 1)]
            order.append((rotary + width, period - offset - width))
        return order

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """The HF tensor's rows as runs of the megatron-core tensor's (of `shape`): the same rows, or, in
        rotate-half order, rotary dims i and i + width/2 from rows 2i and 2i + 1 of each group's rotary rows."""
        order = self._order(shape[0], dims)
        if order is None:
            return {self.hf: merged([(MCORE, 0, shape[0])])}
        mcore_row = [0] * shape[0]  # HF row -> megatron-core row
        at = 0
        for first, count in order:
            mcore_row[first : first + count] = range(at, at + count)
            at += count
        return {self.hf: merged((MCORE, row, 1) for row in mcore_row)}

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """The megatron-core tensor's rows as runs of the HF tensor's: the same rows, or, from rotate-half order,
        each group's rotary rows i and i + width/2 as rows 2i and 2i + 1."""
        rows = shapes[self.hf][0]
        order = self._order(rows, dims)
        return merged((self.hf, first, count) for first, count in order or [(0, rows)])

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        tensor = tensors[self.hf]
        return interleave_rotary_rows(tensor, *self._rows(dims)) if dims.rotate_half_rotary else tensor

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        if dims.rotate_half_rotary:
            tensor = deinterleave_rotary_rows(tensor, *self._rows(dims))
        return {self.hf: tensor}


@dataclass(frozen=True)
class GatedQKV:
    """A gated attention's q/k/v (Qwen3-Next, Qwen3.5): HF's `q_proj` holds per head its query rows then its output
    gate's; megatron-core's `linear_qkv` with `attention_output_gate` holds per query group its query heads, their
    gates, its key head and its value head."""

    mcore: str
    q: str
    k: str
    v: str
    parallel: Parallel = Parallel.COLUMN
    untied_only: bool = False
    layers: LayerKind = LayerKind.ALL
    requires: Feature | None = None
    attention: str | None = None
    """As `Direct.attention`."""

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.q, self.k, self.v)

    def hf_expected(self) -> dict[str, Shape]:
        return {self.q: (Size.Q_GATED, Size.HIDDEN), self.k: (Size.KV, Size.HIDDEN), self.v: (Size.KV, Size.HIDDEN)}

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        q, k, v = shapes[self.q], shapes[self.k], shapes[self.v]
        _expect(self.q, q[0], 2 * dims.num_attention_heads * dims.head_dim, "2 * num_attention_heads * head_dim")
        _expect(self.k, k[0], dims.num_query_groups * dims.head_dim, "num_key_value_heads * head_dim")
        _expect(self.v, v[0], dims.num_query_groups * dims.head_dim, "num_key_value_heads * head_dim")
        return (q[0] + k[0] + v[0], *q[1:])

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        kv = dims.num_query_groups * dims.head_dim
        _expect(self.mcore, shape[0], 2 * dims.num_attention_heads * dims.head_dim + 2 * kv, "q + gate + k + v rows")
        tail = shape[1:]
        return {self.q: (2 * dims.num_attention_heads * dims.head_dim, *tail), self.k: (kv, *tail), self.v: (kv, *tail)}

    def _layout(self, dims: Dims) -> tuple[int, int, int, int]:
        """(query groups, heads per group, head_dim, rows per group of the fused tensor)."""
        groups, head = dims.num_query_groups, dims.head_dim
        per = dims.num_attention_heads // groups
        return groups, per, head, 2 * per * head + 2 * head

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """q's rows (per head: query, gate), k's and v's as runs of the fused tensor's. ValueError: a row count that
        is not `num_query_groups` groups."""
        groups, per, head, period = self._layout(dims)
        if shape[0] != groups * period:
            raise ValueError(f"{self.mcore} has {shape[0]} rows, not {groups} query groups of {period}")
        q = []
        for g in range(groups):
            for i in range(per):
                q += [(MCORE, g * period + i * head, head), (MCORE, g * period + (per + i) * head, head)]
        return {
            self.q: merged(q),
            self.k: merged((MCORE, g * period + 2 * per * head, head) for g in range(groups)),
            self.v: merged((MCORE, g * period + 2 * per * head + head, head) for g in range(groups)),
        }

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """Per query group: its heads' query rows, their gate rows, its k rows, its v rows."""
        groups, per, head, _ = self._layout(dims)
        runs: list[tuple[str | None, int, int]] = []
        for g in range(groups):
            heads = range(g * per, (g + 1) * per)
            runs += [(self.q, 2 * h * head, head) for h in heads]
            runs += [(self.q, 2 * h * head + head, head) for h in heads]
            runs += [(self.k, g * head, head), (self.v, g * head, head)]
        return merged(runs)

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        import torch

        groups, per, head, _ = self._layout(dims)
        q = tensors[self.q]
        tail = q.shape[1:]
        both = q.reshape(groups, per, 2, head, *tail)
        parts = (
            both[:, :, 0].reshape(groups, per * head, *tail),
            both[:, :, 1].reshape(groups, per * head, *tail),
            tensors[self.k].reshape(groups, head, *tail),
            tensors[self.v].reshape(groups, head, *tail),
        )
        return torch.cat(parts, dim=1).reshape(-1, *tail)

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        import torch

        groups, per, head, period = self._layout(dims)
        tail = tensor.shape[1:]
        query, gate, k, v = tensor.reshape(groups, period, *tail).split([per * head, per * head, head, head], dim=1)
        q = torch.stack((query.reshape(groups, per, head, *tail), gate.reshape(groups, per, head, *tail)), dim=2)
        return {
            self.q: q.reshape(-1, *tail).contiguous(),
            self.k: k.reshape(-1, *tail).contiguous(),
            self.v: v.reshape(-1, *tail).contiguous(),
        }


@dataclass(frozen=True)
class LinearInProj:
    """Gated DeltaNet's input projection, split as Qwen3.5 stores it (`in_proj_qkv` = [q; k; v], `in_proj_z`,
    `in_proj_b`, `in_proj_a`): megatron-core's `in_proj` is, over the whole model, `[q; k; v; z; beta; alpha]`, each
    part split over TP on its own (`Parallel.COLUMN_PARTS`, `Dims.linear_parts`)."""

    mcore: str
    qkv: str
    z: str
    b: str
    a: str
    parallel: Parallel = Parallel.COLUMN_PARTS
    untied_only: bool = False
    layers: LayerKind = LayerKind.ALL
    requires: Feature | None = None
    attention: str | None = None
    """As `Direct.attention`."""

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.qkv, self.z, self.b, self.a)

    def hf_expected(self) -> dict[str, Shape]:
        return {
            self.qkv: (Size.LINEAR_QKV, Size.HIDDEN),
            self.z: (Size.LINEAR_V, Size.HIDDEN),
            self.b: (Size.LINEAR_HEADS, Size.HIDDEN),
            self.a: (Size.LINEAR_HEADS, Size.HIDDEN),
        }

    def _rows(self, dims: Dims) -> dict[str, int]:
        parts = dims.linear_parts()
        return {
            self.qkv: parts["query"] + parts["key"] + parts["value"],
            self.z: parts["z"],
            self.b: parts["beta"],
            self.a: parts["alpha"],
        }

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        for name, rows in self._rows(dims).items():
            _expect(name, shapes[name][0], rows, "the linear attention's heads and head dims")
        return (sum(shapes[name][0] for name in self.hf_sources), *shapes[self.qkv][1:])

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        rows = self._rows(dims)
        _expect(self.mcore, shape[0], sum(rows.values()), "q + k + v + z + beta + alpha rows")
        return {name: (count, *shape[1:]) for name, count in rows.items()}

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """Each HF tensor's rows: the next run of the megatron-core tensor's. ValueError: another row count."""
        rows, out, first = self._rows(dims), {}, 0
        if shape[0] != sum(rows.values()):
            raise ValueError(f"{self.mcore} has {shape[0]} rows, not {sum(rows.values())}")
        for name, count in rows.items():
            out[name] = merged([(MCORE, first, count)])
            first += count
        return out

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """qkv's rows, then z's, b's and a's."""
        return merged((name, 0, shapes[name][0]) for name in self.hf_sources)

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        import torch

        return torch.cat([tensors[name] for name in self.hf_sources])

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        rows = self._rows(dims)
        parts = tensor.split(list(rows.values()))
        return {name: part.contiguous() for name, part in zip(rows, parts, strict=True)}


@dataclass(frozen=True)
class GroupedLinearInProj:
    """Gated DeltaNet's input projection fused per key head as Qwen3-Next stores it: `in_proj_qkvz` holds for each
    key head its query, its key, then the values and the gate inputs (`z`) of the value heads it serves;
    `in_proj_ba` for each key head the `b` rows, then the `a` rows of those value heads (transformers'
    `fix_query_key_value_ordering`). megatron-core's `in_proj` is `[q; k; v; z; beta; alpha]` over the whole model,
    as for `LinearInProj`."""

    mcore: str
    qkvz: str
    ba: str
    parallel: Parallel = Parallel.COLUMN_PARTS
    untied_only: bool = False
    layers: LayerKind = LayerKind.ALL
    requires: Feature | None = None
    attention: str | None = None
    """As `Direct.attention`."""

    @property
    def hf_sources(self) -> tuple[str, ...]:
        return (self.qkvz, self.ba)

    def hf_expected(self) -> dict[str, Shape]:
        return {self.qkvz: (Size.LINEAR_QKVZ, Size.HIDDEN), self.ba: (Size.LINEAR_BA, Size.HIDDEN)}

    def _groups(self, dims: Dims) -> tuple[int, list[int], list[int]]:
        """(key heads, one key head's rows of qkvz per part q/k/v/z, of ba per part b/a)."""
        groups = dims.linear_key_heads
        per = dims.linear_value_heads // groups
        key, value = dims.linear_key_head_dim, per * dims.linear_value_head_dim
        return groups, [key, key, value, value], [per, per]

    def mcore_shape(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[int, ...]:
        groups, qkvz, ba = self._groups(dims)
        _expect(self.qkvz, shapes[self.qkvz][0], groups * sum(qkvz), "the linear attention's q/k/v/z rows")
        _expect(self.ba, shapes[self.ba][0], groups * sum(ba), "2 * linear_num_value_heads")
        return (shapes[self.qkvz][0] + shapes[self.ba][0], *shapes[self.qkvz][1:])

    def hf_shapes(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[int, ...]]:
        groups, qkvz, ba = self._groups(dims)
        _expect(self.mcore, shape[0], groups * (sum(qkvz) + sum(ba)), "q + k + v + z + beta + alpha rows")
        return {self.qkvz: (groups * sum(qkvz), *shape[1:]), self.ba: (groups * sum(ba), *shape[1:])}

    def _segments(self, dims: Dims) -> list[tuple[str, int, int, int]]:
        """(HF tensor, its first row, the megatron-core tensor's first row, rows) of every run, per key head."""
        groups, qkvz, ba = self._groups(dims)
        out, start = [], 0
        for name, sizes in ((self.qkvz, qkvz), (self.ba, ba)):
            for part, size in enumerate(sizes):
                out += [(name, g * sum(sizes) + sum(sizes[:part]), start + g * size, size) for g in range(groups)]
                start += groups * size
        return out

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        """Each HF tensor's rows, per key head, as runs of the megatron-core tensor's. ValueError: another row
        count."""
        groups, qkvz, ba = self._groups(dims)
        if groups <= 0 or shape[0] != groups * (sum(qkvz) + sum(ba)):
            raise ValueError(f"{self.mcore} has {shape[0]} rows, not {groups} key heads' q/k/v/z/b/a")
        runs = sorted(self._segments(dims), key=lambda seg: (seg[0] != self.qkvz, seg[1]))
        return {
            name: merged((MCORE, first, size) for hf, _, first, size in runs if hf == name) for name in self.hf_sources
        }

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        """q of every key head, then k, v, z, b, a, each a run of its HF tensor's rows."""
        return merged((name, first, size) for name, first, _, size in self._segments(dims))

    def to_mcore(self, tensors: Mapping[str, torch.Tensor], dims: Dims) -> torch.Tensor:
        import torch

        groups, qkvz, ba = self._groups(dims)
        parts = []
        for name, sizes in ((self.qkvz, qkvz), (self.ba, ba)):
            tensor = tensors[name]
            tail = tensor.shape[1:]
            grouped = tensor.reshape(groups, sum(sizes), *tail).split(sizes, dim=1)
            parts += [part.reshape(-1, *tail) for part in grouped]
        return torch.cat(parts)

    def to_hf(self, tensor: torch.Tensor, dims: Dims) -> dict[str, torch.Tensor]:
        import torch

        groups, qkvz, ba = self._groups(dims)
        tail = tensor.shape[1:]
        parts = tensor.split([groups * size for size in (*qkvz, *ba)])
        grouped = [part.reshape(groups, -1, *tail) for part in parts]
        return {
            self.qkvz: torch.cat(grouped[:4], dim=1).reshape(-1, *tail).contiguous(),
            self.ba: torch.cat(grouped[4:], dim=1).reshape(-1, *tail).contiguous(),
        }


Entry = Direct | FusedQKV | FusedGateUp | RotaryRows | GatedQKV | LinearInProj | GroupedLinearInProj


def keeps_float32(entry: Entry) -> bool:
    """Whether an entry's tensor is held in float32 whatever the model's dtype (`Direct.float32`)."""
    return isinstance(entry, Direct) and entry.float32


def _expect(name: str, actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise CheckpointError(f"{name} has {actual} rows, but the config implies {what} = {expected}")


def is_layered(name: str) -> bool:
    """Whether a name has the `{layer}` placeholder (one tensor per decoder layer)."""
    return LAYER in name


def is_expert(name: str) -> bool:
    """Whether a name has the `{expert}` placeholder (one tensor per routed expert)."""
    return EXPERT in name


def at_layer(entry: Entry, layer: int | None, expert: int | None = None, mcore_layer: int | None = None) -> Entry:
    """The entry with `{layer}` and `{expert}` substituted in every name it holds; `mcore_layer`, where given, is
    the layer index of the megatron-core name (a multi-token-prediction layer's, which HF numbers after the
    decoder's layers)."""
    if layer is None and expert is None:
        return entry

    def index(field: str) -> int | None:
        return mcore_layer if field == "mcore" and mcore_layer is not None else layer

    text = [f.name for f in fields(entry) if f.type in ("str", str)]
    return replace(entry, **{name: fill(getattr(entry, name), index(name), expert) for name in text})
