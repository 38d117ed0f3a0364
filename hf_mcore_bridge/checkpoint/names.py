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


SPLIT_TENSORS = {
    "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "self_attention.conv1d.weight": ("query", "key", "value"),
}
"""The tensors megatron-core's `GatedDeltaNet.sharded_state_dict` saves in parts (`_split_tensor_factory`), under
`<key>.<part>`, in the order its module holds them."""


def split_tensor_parts(key: str) -> tuple[str, ...] | None:
    """The part names a checkpoint key is saved under (`SPLIT_TENSORS`), or None."""
    return next((parts for suffix, parts in SPLIT_TENSORS.items() if key.endswith(suffix)), None)
