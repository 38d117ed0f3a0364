"""Multi-token-prediction (MTP) layers: how many a checkpoint holds, and when conversion leaves them out.

DeepSeek-V3 and GLM-4.5 publish their `num_nextn_predict_layers` MTP layers as HF layers numbered after the
decoder's (`model.layers.61.*`, `model.layers.92.*`); transformers neither builds nor saves them, yet its
DeepSeek-V3 config declares one by default. So the layers converted are those the checkpoint holds:

- import (`resolve_import`): declared layers of which the checkpoint holds no tensor are noted and not converted;
  layers it holds become megatron-core's MTP (`mtp.layers.{i}`, `mtp_num_layers`). megatron-core's MTP shares the
  model's embedding and output layer, so an MTP layer's own copies of them (`Architecture.mtp_copies`) must equal
  the model's (compared row block by row block, never whole); the legacy `torch` format is not written with MTP
  layers. Layers megatron-core cannot hold so are dropped with a one-line notice, or refused with `strict`.
- export (`resolve_export`): the checkpoint's `mtp.layers.{i}` say how many; the copies are written again from
  the shared tensors (`copies`).

megatron-core's `GPTModel` with `mtp_num_layers` set computes the MTP loss on every forward and needs labels for it, so
what needs logits builds the model without them: `bridge verify` checks the decoder's logits, and the GRPO trainer
builds, refits and saves its policy without them (its exports say so in a note).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from hf_mcore_bridge.checkpoint.hf_dir import HFCheckpoint
from hf_mcore_bridge.checkpoint.names import fill
from hf_mcore_bridge.convert.model_plan import placed_entries
from hf_mcore_bridge.errors import CheckpointError
from hf_mcore_bridge.models.mapping_types import LayerKind
from hf_mcore_bridge.models.spec import ModelSpec

COMPARE_ROWS = 4096
"""Rows of a copy and of its original compared at a time."""
_MTP_KEY = re.compile(r"mtp\.layers\.(\d+)\.")


@dataclass(frozen=True)
class MtpImport:
    """What becomes of a checkpoint's MTP layers."""

    model: ModelSpec
    """The model with the MTP layers that are converted."""
    note: str | None
    """One line for the user where layers are not converted."""
    accepted: frozenset[str]
    """HF tensors that are read but not converted: the copies of shared tensors, or dropped layers."""


def copies(model: ModelSpec) -> dict[str, str]:
    """Each MTP layer's copy of a shared tensor (HF name) -> the HF name of the tensor it copies."""
    arch = model.arch
    if arch.mtp_copies is None:
        return {}
    return {
        fill(template, model.num_layers + index): original
        for index in range(model.mtp_layers)
        for template, original in arch.mtp_copies.items()
    }


def _layer_names(model: ModelSpec) -> set[str]:
    return {name for p in placed_entries(model) if p.template.layers is LayerKind.MTP for name in p.hf_names()}


def _differs(hf: HFCheckpoint, copy: str, original: str) -> bool:
    import torch

    if copy not in hf.names():
        return False  # not stored: nothing to keep apart (export writes it)
    if hf.info(copy).shape != hf.info(original).shape:
        return True
    rows = hf.info(original).shape[0]
    for start in range(0, rows, COMPARE_ROWS):
        span = (start, min(rows, start + COMPARE_ROWS))
        if not torch.equal(hf.read(copy, span), hf.read(original, span)):
            return True
    return False


def _unholdable(model: ModelSpec, hf: HFCheckpoint, legacy: bool) -> str | None:
    """Why megatron-core cannot hold the checkpoint's MTP layers, or None."""
    if legacy:
        return "the legacy torch format is not written with MTP layers (use torch_dist)"
    if model.tie_word_embeddings:
        return "with tied embeddings"
    if not model.is_moe_layer(model.num_layers - 1):
        return "megatron-core builds an MTP layer like the last decoder layer, which is dense here"
    for copy, original in copies(model).items():
        if _differs(hf, copy, original):
            return f"{copy} differs from {original}, which megatron-core's MTP shares"
    return None


def resolve_import(model: ModelSpec, hf: HFCheckpoint, *, legacy: bool = False, strict: bool = False) -> MtpImport:
    """The MTP layers of an HF checkpoint that conversion takes (see the module docstring)."""
    declared = model.mtp_layers
    if not declared:
        return MtpImport(model, None, frozenset())
    layers, shared = _layer_names(model), copies(model)
    if not layers & hf.names():
        note = (
            f"config.json declares num_nextn_predict_layers={declared} but the checkpoint holds none of their "
            "tensors: converted without multi-token-prediction layers"
        )
        return MtpImport(replace(model, mtp_layers=0), note, frozenset())
    reason = _unholdable(model, hf, legacy)
    if reason is None:
        return MtpImport(model, None, frozenset(shared) & hf.names())
    if strict:
        raise CheckpointError(f"the {declared} multi-token-prediction layer(s) cannot be converted: {reason}")
    note = f"{declared} multi-token-prediction layer(s) dropped: {reason} (--strict-mtp refuses instead)"
    return MtpImport(replace(model, mtp_layers=0), note, frozenset(layers | set(shared)))


def resolve_export(model: ModelSpec, keys: set[str]) -> tuple[ModelSpec, str | None]:
    """The model with as many MTP layers as a megatron-core checkpoint holds (`mtp.layers.{i}` keys)."""
    held = len({match.group(1) for key in keys if (match := _MTP_KEY.match(key))})
    if held == model.mtp_layers:
        return model, None
    note = (
        f"the config declares num_nextn_predict_layers={model.mtp_layers}, the checkpoint holds {held} "
        f"multi-token-prediction layer(s): exported with {held}"
    )
    return replace(model, mtp_layers=held), note
