"""A model's concrete tensor list: the architecture's table expanded over decoder layers, and checked names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from hf_mcore_bridge.architecture import Architecture
from hf_mcore_bridge.config_bridge import ModelConfig
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.mapping_types import Entry, at_layer, is_layered

IGNORABLE_HF = (re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq"),)
"""HF tensors that carry no weights (old checkpoints saved RoPE buffers)."""


@dataclass(frozen=True)
class Placed:
    """One table entry at one decoder layer (or at none, for embedding/final norm/output)."""

    template: Entry
    """The table entry, names with `{layer}` placeholders."""
    layer: int | None

    @property
    def entry(self) -> Entry:
        """The entry with this layer's names."""
        return at_layer(self.template, self.layer)

    @property
    def mcore_name(self) -> str:
        return self.entry.mcore

    def hf_names(self) -> tuple[str, ...]:
        return self.entry.hf_sources


def placed_entries(arch: Architecture, model: ModelConfig) -> list[Placed]:
    """Every tensor of the model in table order, layer by layer for layered entries."""
    entries = [e for e in arch.table if not (e.untied_only and model.tie_word_embeddings)]
    placed = [Placed(e, None) for e in entries if not is_layered(e.mcore) and e.mcore.startswith("embedding")]
    for layer in range(model.num_layers):
        placed += [Placed(e, layer) for e in entries if is_layered(e.mcore)]
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
