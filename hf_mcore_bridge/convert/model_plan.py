"""A model's concrete tensor list: the architecture's table expanded over decoder layers and experts."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hf_mcore_bridge.convert.architecture import Architecture
from hf_mcore_bridge.convert.config_bridge import ModelConfig
from hf_mcore_bridge.convert.mapping_types import (
    Entry,
    LayerKind,
    Placement,
    at_layer,
    is_expert,
    is_layered,
    placement,
)
from hf_mcore_bridge.errors import CheckpointError

IGNORABLE_HF = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
"""HF tensors that carry no weights (old checkpoints saved RoPE buffers)."""


@dataclass(frozen=True)
class Placed:
    """One table entry at one decoder layer and expert (or at none, for embedding/final norm/output)."""

    template: Entry
    """The table entry, names with `{layer}` / `{expert}` placeholders."""
    layer: int | None
    expert: int | None = None

    @property
    def entry(self) -> Entry:
        """The entry with this layer's and expert's names."""
        return at_layer(self.template, self.layer, self.expert)

    @property
    def mcore_name(self) -> str:
        return self.entry.mcore

    def hf_names(self) -> tuple[str, ...]:
        return self.entry.hf_sources

    def placement(self, model: ModelConfig, *, spec: str = "te", stacked: bool | None = None) -> Placement:
        """Where this tensor lives in a distributed checkpoint of `model`."""
        return placement(
            self.template.mcore,
            layer=self.layer,
            expert=self.expert,
            num_layers=model.num_layers,
            num_experts=model.moe.num_experts if model.moe else None,
            stacked=model.homogeneous if stacked is None else stacked,
            spec=spec,
        )


def _applies(entry: Entry, model: ModelConfig, layer: int) -> bool:
    if entry.layers is LayerKind.ALL:
        return True
    return (entry.layers is LayerKind.MOE) == model.is_moe_layer(layer)


def placed_entries(arch: Architecture, model: ModelConfig) -> list[Placed]:
    """Every tensor of the model in table order, layer by layer, expert by expert."""
    entries = [
        e
        for e in arch.table
        if not (e.untied_only and model.tie_word_embeddings) and (e.requires is None or model.has(e.requires))
    ]
    placed = [Placed(e, None) for e in entries if not is_layered(e.mcore) and e.mcore.startswith("embedding")]
    experts = range(model.moe.num_experts) if model.moe else range(0)
    for layer in range(model.num_layers):
        for e in entries:
            if not is_layered(e.mcore) or not _applies(e, model, layer):
                continue
            if is_expert(e.mcore):
                placed += [Placed(e, layer, x) for x in experts]
            else:
                placed.append(Placed(e, layer))
    placed += [Placed(e, None) for e in entries if not is_layered(e.mcore) and not e.mcore.startswith("embedding")]
    return placed


def check_hf_names(placed: list[Placed], available: set[str], model: ModelConfig, *, ignore_unknown: bool) -> None:
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
