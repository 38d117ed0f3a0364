"""Tensor-name templates: `{layer}` and `{expert}` placeholders, and their substitution.

Mapping tables, checkpoint readers and the engine's weight names all write per-layer and per-expert names this
way (named placeholders, never positional ones).
"""

from __future__ import annotations

LAYER = "{layer}"
EXPERT = "{expert}"


def fill(name: str, layer: int | None, expert: int | None = None) -> str:
    """Substitute the decoder layer and expert indices into a name."""
    if layer is not None:
        name = name.replace(LAYER, str(layer))
    if expert is not None:
        name = name.replace(EXPERT, str(expert))
    return name
