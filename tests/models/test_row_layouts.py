"""The row layouts the entry types declare (`hf_rows`, `mcore_rows`) against their own torch transforms, traced.

Conversions copy rows unchanged as the entry type declares them, without running its transform; `row_trace`
reads the rows off the transform itself (on integer row tags), an independent reference. Every tensor of every
registered architecture's tiny model is checked both ways, with and without vocabulary padding, DeepSeek-V3's
rotary rows in both orders, and one query group up to one per head; a layout with k and v swapped, or one
padding row too few, must be told apart. Declaring a layout needs no torch.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import pytest
from row_trace import trace

from hf_mcore_bridge.convert import config_bridge
from hf_mcore_bridge.convert.input_checks import concrete, hf_sizes
from hf_mcore_bridge.convert.model_plan import placed_entries
from hf_mcore_bridge.models.architecture import Architecture
from hf_mcore_bridge.models.mapping_types import (
    Dims,
    Direct,
    Entry,
    FusedQKV,
    GroupedLinearInProj,
    RotaryRows,
    Size,
)
from hf_mcore_bridge.models.parallel_style import Parallel
from hf_mcore_bridge.models.registry import REGISTRY
from hf_mcore_bridge.models.row_runs import MCORE, RowRun
from hf_mcore_bridge.models.tensor_ops import padded_vocab_size
from hf_mcore_bridge.models.tiny_models import tiny_config


@dataclass(frozen=True)
class Case:
    architecture: str
    overrides: dict[str, Any] = field(default_factory=dict)
    divisible_by: int = 128
    """Megatron-LM's `make_vocab_size_divisible_by` (1: no padding)."""
    has: frozenset[tuple[str, int]] = frozenset({("Direct", 1), ("Direct", 2), ("FusedGateUp", 2)})
    """(entry type, tensor rank) pairs the model must have, so the case checks what it is meant to."""


_QKV = frozenset({("Direct", 1), ("Direct", 2), ("FusedGateUp", 2), ("FusedQKV", 2)})
_MLA = frozenset({("Direct", 1), ("Direct", 2), ("FusedGateUp", 2), ("RotaryRows", 2)})
_HYBRID = frozenset({("Direct", 1), ("Direct", 2), ("FusedGateUp", 2), ("GatedQKV", 2), ("LinearInProj", 2)})
"""Gated attention and Gated DeltaNet's input projection (Qwen3.5)."""


def _kinds(arch: Architecture) -> frozenset[tuple[str, int]]:
    if arch.linear_attention and any(isinstance(e, GroupedLinearInProj) for e in arch.table):
        return _HYBRID - {("LinearInProj", 2)} | {("GroupedLinearInProj", 2)}
    return _HYBRID if arch.linear_attention else _MLA if arch.multi_latent else _QKV


CASES = {
    **{arch.model_type: Case(name, has=_kinds(arch)) for name, arch in REGISTRY.items()},
    "qwen2-biases": Case("Qwen2ForCausalLM", has=_QKV | {("FusedQKV", 1)}),
    "llama-unpadded": Case("LlamaForCausalLM", divisible_by=1, has=_QKV),
    "llama-one-group": Case("LlamaForCausalLM", {"num_key_value_heads": 1}, has=_QKV),
    "llama-one-group-per-head": Case("LlamaForCausalLM", {"num_key_value_heads": 8}, has=_QKV),
    "deepseek_v3-rotate-half": Case("DeepseekV3ForCausalLM", {"rope_interleave": False}, has=_MLA),
    "deepseek_v3-interleaved": Case("DeepseekV3ForCausalLM", {"rope_interleave": True}, has=_MLA),
    "deepseek_v3-full-rank-q": Case("DeepseekV3ForCausalLM", {"q_lora_rank": None, "rope_interleave": False}, has=_MLA),
}

Tensors = list[tuple[Entry, dict[str, tuple[int, ...]], tuple[int, ...]]]


def _tensors(case: Case) -> tuple[Dims, Tensors]:
    """The dims and every placed entry of a case's tiny model, with its HF shapes and megatron-core shape."""
    config = tiny_config(case.architecture, **case.overrides)
    model = config_bridge.megatron_spec(config)
    dims = model.dims(padded_vocab_size(model.vocab_size, case.divisible_by, 1))
    sizes = hf_sizes(model, config)
    out = []
    for placed in placed_entries(model):
        entry = placed.entry
        shapes = {name: concrete(shape, sizes) for name, shape in entry.hf_expected().items()}
        out.append((entry, shapes, entry.mcore_shape(shapes, dims)))
    return dims, out


def _mismatches(entry: Entry, shapes: Mapping[str, tuple[int, ...]], shape: tuple[int, ...], dims: Dims) -> list[str]:
    """Where the declared rows differ from the traced ones, in either direction."""
    found = []
    exported = trace(lambda t: entry.to_hf(t[MCORE], dims), {MCORE: shape})
    if entry.hf_rows(shape, dims) != exported:
        found.append(f"export {entry.mcore}: declared {entry.hf_rows(shape, dims)}, traced {exported}")
    imported = trace(lambda t: {"out": entry.to_mcore(t, dims)}, shapes)
    if imported is None or entry.mcore_rows(shapes, dims) != imported["out"]:
        found.append(f"import {entry.mcore}: declared {entry.mcore_rows(shapes, dims)}, traced {imported}")
    return found


@pytest.mark.parametrize("name", list(CASES))
def test_declared_rows_are_the_transforms_rows(name: str) -> None:
    case = CASES[name]
    dims, tensors = _tensors(case)
    checked = [(entry, shapes, shape) for entry, shapes, shape in tensors if len(shape) in (1, 2)]
    assert case.has <= {(type(entry).__name__, len(shape)) for entry, _, shape in checked}
    assert (dims.padded_vocab_size > dims.vocab_size) == (case.divisible_by > 1)
    assert dims.rotate_half_rotary == (case.overrides.get("rope_interleave") is False)
    assert [m for entry, shapes, shape in checked for m in _mismatches(entry, shapes, shape, dims)] == []


DIMS = Dims(num_attention_heads=8, num_query_groups=4, head_dim=4, vocab_size=11, padded_vocab_size=16)
QKV = FusedQKV("qkv", "q", "k", "v")
QKV_SHAPES = {"q": (32, 3), "k": (16, 3), "v": (16, 3)}


@dataclass(frozen=True)
class SwappedKV(FusedQKV):
    """A wrong layout: k's rows declared where v's are, and the other way round."""

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        rows = super().hf_rows(shape, dims)
        return {**rows, self.k: rows[self.v], self.v: rows[self.k]}

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        swap = {self.k: self.v, self.v: self.k}
        return tuple(replace(run, source=swap.get(run.source, run.source)) for run in super().mcore_rows(shapes, dims))


@dataclass(frozen=True)
class ShortPadding(Direct):
    """A wrong layout: one padding row too few on import, one vocabulary row too many kept on export."""

    def hf_rows(self, shape: tuple[int, ...], dims: Dims) -> dict[str, tuple[RowRun, ...]]:
        return {self.hf: (RowRun(0, dims.vocab_size + 1, MCORE, 0),)}

    def mcore_rows(self, shapes: Mapping[str, tuple[int, ...]], dims: Dims) -> tuple[RowRun, ...]:
        *kept, padding = super().mcore_rows(shapes, dims)
        return (*kept, replace(padding, count=padding.count - 1))


def test_a_wrong_layout_is_reported_both_ways() -> None:
    assert _mismatches(QKV, QKV_SHAPES, (64, 3), DIMS) == []
    swapped = SwappedKV("qkv", "q", "k", "v")
    assert [m.split(":")[0] for m in _mismatches(swapped, QKV_SHAPES, (64, 3), DIMS)] == ["export qkv", "import qkv"]
    embedding = Direct("emb", "e", Parallel.VOCAB, (Size.VOCAB, Size.HIDDEN))
    assert _mismatches(embedding, {"e": (11, 3)}, (16, 3), DIMS) == []
    short = ShortPadding("emb", "e", Parallel.VOCAB, (Size.VOCAB, Size.HIDDEN))
    assert [m.split(":")[0] for m in _mismatches(short, {"e": (11, 3)}, (16, 3), DIMS)] == ["export emb", "import emb"]


def test_a_layout_that_does_not_fit_the_shape_is_refused_as_the_transform_refuses_it() -> None:
    """The conversions copy nothing where a layout does not fit (ValueError), as they did where the traced
    transform failed (None)."""
    rotary = RotaryRows("q_up", "q", (Size.MLA_Q, Size.Q_LORA), per_head=True)
    mla = replace(DIMS, qk_nope_head_dim=4, qk_rope_head_dim=4, rotate_half_rotary=True)
    embedding = Direct("emb", "e", Parallel.VOCAB, (Size.VOCAB, Size.HIDDEN))
    odd_q = {**QKV_SHAPES, "q": (30, 3)}  # not 4 query groups
    refused = [
        (lambda: QKV.hf_rows((60, 3), DIMS), lambda t: QKV.to_hf(t[MCORE], DIMS), {MCORE: (60, 3)}),
        (lambda: QKV.mcore_rows(odd_q, DIMS), lambda t: {"out": QKV.to_mcore(t, DIMS)}, odd_q),
        (lambda: rotary.hf_rows((20, 3), mla), lambda t: rotary.to_hf(t[MCORE], mla), {MCORE: (20, 3)}),
        (lambda: rotary.mcore_rows({"q": (20, 3)}, mla), lambda t: {"out": rotary.to_mcore(t, mla)}, {"q": (20, 3)}),
        (
            lambda: embedding.mcore_rows({"e": (17, 3)}, DIMS),
            lambda t: {"out": embedding.to_mcore(t, DIMS)},
            {"e": (17, 3)},
        ),
    ]
    for declared, transform, shapes in refused:
        with pytest.raises(ValueError):
            declared()
        assert trace(transform, shapes) is None


def test_declaring_a_layout_imports_no_torch() -> None:
    code = (
        "import sys\n"
        "from hf_mcore_bridge.models.mapping_types import Dims, FusedQKV\n"
        "dims = Dims(num_attention_heads=8, num_query_groups=4, head_dim=4, vocab_size=11, padded_vocab_size=16)\n"
        "FusedQKV('qkv', 'q', 'k', 'v').hf_rows((64, 3), dims)\n"
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch or numpy imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
