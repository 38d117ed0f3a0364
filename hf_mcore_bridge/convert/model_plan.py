"""A model's concrete tensor list: the architecture's table expanded over decoder layers and experts."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hf_mcore_bridge.convert.placement import Placement, placement
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.mapping_types import Entry, LayerKind, at_layer, is_expert, is_layered
from hf_mcore_bridge.models.spec import ModelSpec

IGNORABLE_HF = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
"""HF tensors that carry no weights (old checkpoints saved RoPE buffers)."""


@dataclass(frozen=True)
class Placed:
    """One table entry at one decoder layer and expert (or at none, for embedding/final norm/output)."""

    template: Entry
    """The table entry, names with `{layer}` / `{expert}` placeholders."""
    layer: int | None
    """The HF layer index."""
    expert: int | None = None
    mcore_layer: int | None = None
    """megatron-core's index where it differs from HF's: a multi-token-prediction layer's (`mtp.layers.{i}`)."""

    @property
    def entry(self) -> Entry:
        """The entry with this layer's and expert's names."""
        return at_layer(self.template, self.layer, self.expert, self.mcore_layer)

    @property
    def mcore_index(self) -> int | None:
        """The layer index in megatron-core's names."""
        return self.layer if self.mcore_layer is None else self.mcore_layer

    @property
    def mcore_name(self) -> str:
        return self.entry.mcore

    def hf_names(self) -> tuple[str, ...]:
        return self.entry.hf_sources

    def placement(self, model: ModelSpec, *, spec: str = "te", stacked: bool | None = None) -> Placement:
        """Where this tensor lives in a distributed checkpoint of `model`."""
        return placement(
            self.template.mcore,
            layer=self.mcore_index,
            expert=self.expert,
            num_layers=model.num_layers,
            num_experts=model.moe.num_experts if model.moe else None,
            stacked=model.homogeneous if stacked is None else stacked,
            spec=spec,
            mla=model.mla is not None,
        )


def _applies(entry: Entry, model: ModelSpec, layer: int) -> bool:
    attention = getattr(entry, "attention", None)
    if attention is not None and model.layer_types[layer] != attention:
        return False
    if entry.layers is LayerKind.ALL:
        return True
    if entry.layers is LayerKind.MTP:
        return False
    return (entry.layers is LayerKind.MOE) == model.is_moe_layer(layer)


def placed_entries(model: ModelSpec) -> list[Placed]:
    """Every tensor of the model in table order, layer by layer, expert by expert; then its multi-token-prediction
    layers (HF numbers them after the decoder's layers, megatron-core from 0)."""
    entries = model.table()
    placed = [Placed(e, None) for e in entries if not is_layered(e.mcore) and e.mcore.startswith("embedding")]
    experts = range(model.moe.num_experts) if model.moe else range(0)

    def at(e: Entry, layer: int, mcore_layer: int | None = None) -> list[Placed]:
        if is_expert(e.mcore):
            return [Placed(e, layer, x, mcore_layer) for x in experts]
        return [Placed(e, layer, None, mcore_layer)]

    for layer in range(model.num_layers):
        placed += [p for e in entries if is_layered(e.mcore) and _applies(e, model, layer) for p in at(e, layer)]
    for index in range(model.mtp_layers):
        layer = model.num_layers + index
        placed += [p for e in entries if e.layers is LayerKind.MTP for p in at(e, layer, index)]
    placed += [Placed(e, None) for e in entries if not is_layered(e.mcore) and not e.mcore.startswith("embedding")]
    return placed


def check_hf_names(placed: list[Placed], available: set[str], model: ModelSpec, *, ignore_unknown: bool) -> None:
    """Every expected HF tensor is present; nothing unexpected is (unless `ignore_unknown`)."""
    expected = {name for p in placed for name in p.hf_names()}
    missing = sorted(expected - available)
    if missing:
        raise CheckpointError(f"{len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[0]}")
    extra = sorted(
        name
        for name in available - expected
        if not any(p.fullmatch(name) for p in IGNORABLE_HF)
        and not (model.tie_word_embeddings and name == "lm_head.weight")
    )
    if extra and not ignore_unknown:
        raise CheckpointError(
            f"{len(extra)} unexpected tensor(s) in the checkpoint, e.g. {extra[0]} "
            "(not part of the architecture; pass --ignore-unknown to skip them)"
        )
