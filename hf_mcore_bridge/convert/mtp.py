"""Multi-token-prediction (MTP) layers of an HF checkpoint: found, dropped with a one-line notice, or refused.

DeepSeek-V3- and GLM-4.5-style checkpoints store `num_nextn_predict_layers` MTP layers after the decoder layers,
as `model.layers.{num_hidden_layers + k}.*` (a decoder layer plus `enorm`, `hnorm`, `eh_proj` and
`shared_head.norm`). They are not converted, for what megatron-core 0.16.1 does with them on the local spec:

- It can build them: `get_gpt_mtp_block_spec(..., use_transformer_engine=False)` gives a `MultiTokenPredictionBlock`
  of the same layer (enorm/hnorm, `eh_proj` over `[embedding; hidden]`, the last decoder layer's spec,
  `final_layernorm`; embedding and output layer shared), saved under `mtp.layers.{k}.*`.
- It cannot run a model that has them without labels: `GPTModel._postprocess` calls `labels.clone()` whenever
  `mtp_num_layers` is set (an `AttributeError` on `labels=None`), so no logits come out. With labels it returns
  the loss, not logits, and adds `mtp_loss_scaling_factor` x the MTP loss into the backward (`MTPLossAutoScaler`).

Every use of a converted checkpoint here needs logits from megatron-core: `bridge verify`, the GRPO trainer's
log-probs and training step (its own loss, which an MTP loss would change) and refit. A checkpoint whose `args`
carried `mtp_num_layers` would build, in megatron-core 0.16, a model that cannot produce them; one that held the
weights without saying so would keep tensors no model loads. So conversion drops them and says so in one line;
`drop_mtp=False` (`--no-drop-mtp`) refuses the checkpoint instead. Export writes the field as 0, which is what the
exported weights hold; the engine skips MTP tensors when it loads such a directory.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from hf_mcore_bridge.convert.architecture import Architecture
from hf_mcore_bridge.convert.config_errors import ConfigError


def mtp_layer_count(arch: Architecture, config: Mapping[str, Any]) -> int:
    """The MTP layers an HF config declares (0 for an architecture without them)."""
    if arch.mtp_layers_field is None:
        return 0
    count = arch.with_absent(config).get(arch.mtp_layers_field) or 0
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise ConfigError(f"config field {arch.mtp_layers_field}={count!r} must be a non-negative integer")
    return count


def mtp_prefixes(num_layers: int, count: int) -> tuple[str, ...]:
    """The HF name prefixes of the MTP layers that follow `num_layers` decoder layers."""
    return tuple(f"model.layers.{num_layers + k}." for k in range(count))


def mtp_tensors(arch: Architecture, config: Mapping[str, Any], num_layers: int, names: Iterable[str]) -> list[str]:
    """The HF tensors among `names` that belong to the config's MTP layers."""
    prefixes = mtp_prefixes(num_layers, mtp_layer_count(arch, config))
    return sorted(name for name in names if prefixes and name.startswith(prefixes))


def drop_or_refuse(arch: Architecture, tensors: list[str], num_layers: int, *, drop: bool) -> str:
    """The one-line notice for dropping `tensors` (MTP layers), or the refusal when `drop` is false."""
    layers = sorted({int(name.split(".")[2]) for name in tensors})
    where = ", ".join(f"model.layers.{layer}.*" for layer in layers)
    field = arch.mtp_layers_field
    if not drop:
        raise ConfigError(
            f"the checkpoint has {len(layers)} multi-token-prediction layer(s) ({field}; {where}), which are not "
            "converted (megatron-core 0.16 computes no logits with them); leave out --no-drop-mtp to drop them"
        )
    return (
        f"dropped {len(layers)} multi-token-prediction layer(s) ({field}; {where}: {len(tensors)} tensors): "
        "megatron-core 0.16 computes no logits with them; --no-drop-mtp refuses instead"
    )


def without_mtp(arch: Architecture, config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """An HF config for weights that hold no MTP layers (the field written as 0, also where it was absent, which
    transformers may read as 1), and a note if it said otherwise."""
    field = arch.mtp_layers_field
    if field is None:
        return dict(config), None
    count = mtp_layer_count(arch, config)
    note = f"{field}={count} in the HF config written as 0: the checkpoint holds no MTP layers" if count else None
    return {**config, field: 0}, note
