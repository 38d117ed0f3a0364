"""Where each table entry's tensor lives in a megatron-core distributed checkpoint: its key and leading offsets.

megatron-core stacks the layers of a homogeneous decoder under one key (a leading layer axis) and the routed experts
of a layer under another (a leading expert axis); its local layer spec names some norms otherwise than the
Transformer-Engine spec the tables are written in. These are facts of megatron-core's checkpoints, used by
conversion and by building megatron-core models; the tables themselves (`models.mapping_types`) name tensors only.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_mcore_bridge.checkpoint.names import EXPERT, LAYER, SPLIT_TENSORS
from hf_mcore_bridge.models.mapping_types import Dims, Entry
from hf_mcore_bridge.models.parallel_style import Parallel


@dataclass(frozen=True)
class Placement:
    """Where one tensor of a table entry lives in a distributed checkpoint."""

    key: str
    """The checkpoint key."""
    leading: tuple[int, ...]
    """Offsets on the leading axes (decoder layer when stacked, expert when an expert tensor)."""
    leading_shape: tuple[int, ...]
    """Sizes of the leading axes."""

    def object_key(self, module_key: str) -> str:
        """The key of a megatron `_extra_state` ShardedObject placed like this tensor."""
        offsets = ".".join(map(str, self.leading)) if self.leading else "0"
        shape = ".".join(map(str, self.leading_shape)) if self.leading else "1"
        return f"{module_key}._extra_state/shard_{offsets}_{shape}"


MOE_PRE_MLP_NORM = "pre_mlp_layernorm.weight"
LOCAL_SPEC_MOE_NORM = "mlp.linear_fc1.layer_norm_weight"
LOCAL_MLA_SPEC_KEYS = {
    "mlp.linear_fc1.layer_norm_weight": "pre_mlp_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attention.q_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attention.kv_layernorm.weight",
}
"""Transformer-Engine keys -> the keys of megatron-core's local layer spec with multi-latent attention, which maps
none of its norms onto TE's fused names (a dense layer's pre-MLP norm included)."""


def split_parts(mcore_name: str, dims: Dims) -> list[tuple[str, int, int]] | None:
    """(part, first row, rows) of a tensor megatron-core saves in parts (`SPLIT_TENSORS`), in the whole tensor's
    rows; None for any other tensor."""
    suffix = next((s for s in SPLIT_TENSORS if mcore_name.endswith(s)), None)
    if suffix is None:
        return None
    rows = dims.linear_parts()
    parts, first = [], 0
    for name in SPLIT_TENSORS[suffix]:
        parts.append((name, first, rows[name]))
        first += rows[name]
    return parts


def part_rows(mcore_name: str, dims: Dims) -> tuple[int, ...]:
    """The row counts of megatron-core's parts of a tensor saved in parts (`split_parts`); () for any other."""
    parts = split_parts(mcore_name, dims)
    return tuple(rows for _, _, rows in parts) if parts else ()


def placement(
    template: str,
    *,
    layer: int | None,
    expert: int | None,
    num_layers: int,
    num_experts: int | None,
    stacked: bool = True,
    spec: str = "te",
    mla: bool = False,
) -> Placement:
    """The checkpoint key and leading offsets of `template` at (layer, expert).

    Homogeneous decoders stack layers of one kind under one key with a leading layer axis; heterogeneous ones
    (dense and MoE layers mixed) keep per-layer keys, as multi-token-prediction layers always do (`mtp.layers.`).
    Experts are stacked on an expert axis under `...mlp.experts.experts.*`. The local layer spec saves a MoE
    layer's pre-MLP norm under the name the Transformer-Engine spec uses for a dense layer's fused norm; with
    multi-latent attention (`mla`) it keeps every norm's own name instead (`LOCAL_MLA_SPEC_KEYS`).
    """
    key, leading, shape = template, [], []
    if spec == "local" and mla:
        for te_key, local_key in LOCAL_MLA_SPEC_KEYS.items():
            key = key.replace(te_key, local_key)
    elif spec == "local":
        key = key.replace(MOE_PRE_MLP_NORM, LOCAL_SPEC_MOE_NORM)
    if key.startswith("mtp."):
        stacked = False
    if LAYER in key:
        if stacked:
            key = key.replace(f"{LAYER}.", "")
            leading.append(layer)
            shape.append(num_layers)
        else:
            key = key.replace(LAYER, str(layer))
    if EXPERT in key:
        key = key.replace(f"local_experts.{EXPERT}.", "experts.")
        leading.append(expert)
        shape.append(num_experts)
    return Placement(key, tuple(leading), tuple(shape))


def dcp_key(mcore_name: str) -> str:
    """The stacked checkpoint key of a template (decoder layers and experts on leading axes)."""
    return placement(mcore_name, layer=0, expert=0, num_layers=1, num_experts=1).key


def extra_state_module(entry: Entry) -> str | None:
    """The linear module whose `_extra_state` megatron-core saves alongside this tensor, if any.

    Every tensor-parallel linear layer saves one; norms and routers (replicated) and the vocabulary-parallel
    embedding and output layer do not (megatron-core drops the output layer's for compatibility with old
    checkpoints).
    """
    if entry.parallel in (Parallel.REPLICATED, Parallel.VOCAB) or entry.mcore.endswith(NOT_LINEAR):
        return None
    return entry.mcore.rsplit(".", 1)[0]


NOT_LINEAR = ("self_attention.conv1d.weight", "self_attention.dt_bias", "self_attention.A_log")
"""Tensor-parallel tensors of no linear layer (Gated DeltaNet's convolution and its per-head parameters): no
`_extra_state` beside them."""
