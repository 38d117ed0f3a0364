"""Language models inside vision-language checkpoints (`...ForConditionalGeneration`): one mechanism for every
family whose text model is a registered architecture (Kimi-K2.5's DeepSeek-V3, later Gemma 3's).

A `VisionLanguage` (one per wrapper class, declared in its `mappings/` file, registered in `models.registry`)
says where the text model's config is (`text_config`), how the checkpoint names the text model's tensors (a
`NameLayout`: stored-name prefixes <-> the text architecture's own `model.` / `lm_head.` names) and which of its
other tensors belong to the wrapper (the vision tower, the projector: `carried`). Conversion converts the text
model as its architecture and keeps the rest, unchanged, for export: the wrapper's `config.json` among the HF
assets and the carried tensors' bytes in `CARRIED_FILE` beside it, with the name layout in its metadata, so export
writes the complete original class again. The engine and the trainer read the text config through
`ModelSpec.from_hf` (which unwraps it) and load the text tensors by these names.

Assumes the wrapper's text model is a whole causal LM (its `lm_head` in the checkpoint, or tied), that the
carried tensors are only copied (the trainer never changes them), and that a tensor of neither part is unknown.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

CARRIED_FILE = "carried_tensors.safetensors"
"""The non-text tensors of a wrapper checkpoint, bytes unchanged, kept among a converted checkpoint's HF assets."""
LAYOUT_KEY = "text_name_layout"
"""`CARRIED_FILE`'s metadata key of the name layout (JSON) the text tensors were stored under."""

NameLayout = tuple[tuple[str, str], ...]
"""How a checkpoint stores the text model's tensor names: (stored prefix, text prefix) pairs, the most specific
first; a name takes the first pair whose prefix it starts with, in either direction."""

NESTED: NameLayout = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
"""The text model whole under `language_model.` (LLaVA's original layout; Kimi-K2.5 and Gemma 3 as published)."""
FLAT: NameLayout = (("model.language_model.", "model."), ("lm_head.", "lm_head."))
"""transformers' in-memory layout: the decoder under `model.language_model.`, the output layer at the top."""


@dataclass(frozen=True)
class VisionLanguage:
    """A vision-language wrapper class whose language model is a registered text architecture."""

    hf_name: str
    """The HF `architectures` entry, e.g. `Kimi_K25ForConditionalGeneration`."""
    model_type: str
    """The HF `model_type`, e.g. `kimi_k25`."""
    carried: tuple[str, ...]
    """Stored-name prefixes of the wrapper's own tensors (vision tower, projector), kept unchanged for export."""
    other_names: tuple[str, ...] = ()
    """Other `architectures` entries of the same class (the publisher's remote-code name)."""
    layouts: tuple[NameLayout, ...] = (NESTED, FLAT)
    """The name layouts its checkpoints come in; the one naming most of a checkpoint's tensors is taken."""
    text_field: str = "text_config"
    """The config field holding the text model's config."""
    tied_absent: bool = True
    """The class's `tie_word_embeddings` where its config lacks one: transformers ties the output layer by the
    wrapper's flag, whatever `text_config` says."""

    def names(self) -> tuple[str, ...]:
        return (self.hf_name, *self.other_names)

    def text_config(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """The text model's config, a dict (a transformers sub-config is taken as its `to_dict`), with the
        wrapper's `tie_word_embeddings`."""
        from hf_mcore_bridge.models.config_errors import ConfigError

        text = config.get(self.text_field)
        if hasattr(text, "to_dict"):
            text = text.to_dict()
        if not isinstance(text, Mapping):
            raise ConfigError(f"{self.hf_name} config has no {self.text_field} object (its language model's config)")
        return {**text, "tie_word_embeddings": bool(config.get("tie_word_embeddings", self.tied_absent))}

    def layout_of(self, names: Iterable[str]) -> NameLayout:
        """The layout naming most of these tensors, each as it would write it back (ties: the first declared)."""
        names = list(names)
        return max(self.layouts, key=lambda layout: sum(_round_trips(layout, n) for n in names))

    def is_carried(self, name: str) -> bool:
        return name.startswith(self.carried)


def text_name(layout: NameLayout, stored: str) -> str | None:
    """A stored name's text-model name, or None for a tensor outside the text model."""
    for stored_prefix, text_prefix in layout:
        if stored.startswith(stored_prefix):
            return text_prefix + stored[len(stored_prefix) :]
    return None


def _round_trips(layout: NameLayout, stored: str) -> bool:
    text = text_name(layout, stored)
    return text is not None and stored_name(layout, text) == stored


def stored_name(layout: NameLayout, text: str) -> str:
    """A text-model name as the layout stores it."""
    for stored_prefix, text_prefix in layout:
        if text.startswith(text_prefix):
            return stored_prefix + text[len(text_prefix) :]
    raise ValueError(f"{text} is no text-model name of layout {layout}")


def any_text_name(wrapper: VisionLanguage, stored: str) -> str | None:
    """A stored name's text-model name under the first of the wrapper's layouts that maps it (a stream of names,
    as the engine is given, has no layout to detect); a name already the text model's is kept."""
    if wrapper.is_carried(stored):
        return None
    for layout in wrapper.layouts:
        found = text_name(layout, stored)
        if found is not None:
            return found
    return stored
