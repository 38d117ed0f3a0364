"""Routed experts under the checkpoint's names on the DTensor backend.

transformers 5 holds a mixture-of-experts layer's routed experts fused (`mlp.experts.gate_up_proj`
[experts, 2 * ffn, hidden], `mlp.experts.down_proj` [experts, hidden, ffn]; Mixtral's router renamed), while the HF
checkpoint, the engine's refit check and `bridge export` name each expert's tensors (`mlp.experts.3.gate_proj.weight`,
`up_proj`, `down_proj`). `expert_pieces` lists, per fused in-memory name, the per-expert tensors it holds (the
architecture's `fused_experts` rules, `engine.arch.fused_expert_pieces`); `split` cuts a full fused tensor into them
(views: an expert's slice, its gate rows then its up rows) and `piece_shape` gives their shapes without data.

Assumes plain fused stacks (parts `gate`, `up`, `all`); an architecture whose checkpoint itself stores the experts
fused (`Architecture.fused_checkpoint`, GPT-OSS) keeps its fused names, so nothing is split there. A dense model has
no pieces.
"""

from __future__ import annotations

from typing import Any

import torch

from hf_mcore_bridge.engine.arch import FusedPiece, fused_expert_pieces
from hf_mcore_bridge.errors import BridgeError
from hf_mcore_bridge.models.spec import ModelSpec

__all__ = ["expert_pieces", "piece_shape", "split"]

_PLAIN = ("gate", "up", "all")


def expert_pieces(config: Any) -> dict[str, tuple[FusedPiece, ...]]:
    """Fused in-memory name -> the checkpoint's per-expert tensors it holds, for the transformers `config`'s model;
    {} for a dense model or one whose checkpoint stores its experts fused. BridgeError: a part other than a plain
    slice (`gate`, `up`, `all`)."""
    spec = ModelSpec.from_hf(config)
    if spec.moe is None or spec.arch.fused_checkpoint:
        return {}
    pieces = fused_expert_pieces(spec)
    for name, found in pieces.items():
        odd = [p.part for p in found if p.part not in _PLAIN]
        if odd:
            raise BridgeError(f"{name}: expert part {odd[0]!r} is not a plain slice; not implemented on DTensor")
    return pieces


def _cut(tensor: torch.Tensor, piece: FusedPiece) -> torch.Tensor:
    one = tensor if piece.expert is None else tensor[piece.expert]
    if piece.part == "all":
        return one
    half = one.shape[0] // 2
    return one[:half] if piece.part == "gate" else one[half:]


def split(tensor: torch.Tensor, pieces: tuple[FusedPiece, ...]) -> list[tuple[str, torch.Tensor]]:
    """The per-expert `(name, tensor)` of a full fused tensor, in `pieces`' order (contiguous copies)."""
    return [(piece.name, _cut(tensor, piece).contiguous()) for piece in pieces]


def piece_shape(shape: tuple[int, ...], piece: FusedPiece) -> tuple[int, ...]:
    """The shape of `piece` inside a fused tensor of `shape`."""
    rest = shape if piece.expert is None else shape[1:]
    return rest if piece.part == "all" else (rest[0] // 2, *rest[1:])
