"""Parallel layouts (TP/PP/VPP/CP/EP/ETP) and their validation against a model's shape.

A layout is a property of how megatron-core will run the model; the distributed checkpoint itself stores global
tensors and loads at any layout. The layout still matters for conversion: it pads the vocabulary, chunks tensors
the way the target ranks will read them, and is recorded in the checkpoint's `args`. `validate_layout` checks one
against the model's description (`models.spec.ModelSpec`), which is cheap to read: no torch, no megatron-core.
"""

from __future__ import annotations

from dataclasses import dataclass

from hf_mcore_bridge.errors import LayoutError
from hf_mcore_bridge.models.moe import MoeSpec
from hf_mcore_bridge.models.spec import MlaSpec, ModelSpec


@dataclass(frozen=True)
class Layout:
    """A megatron-core parallel layout."""

    tp: int = 1
    """Tensor-parallel size: attention heads, query groups and FFN width are split over this many ranks."""
    pp: int = 1
    """Pipeline-parallel size: the decoder layers are split into this many stages."""
    vpp: int | None = None
    """Virtual pipeline stages per pipeline rank (interleaved schedule); None for the plain schedule."""
    cp: int = 1
    """Context-parallel size: the sequence is split over this many ranks."""
    ep: int = 1
    """Expert-parallel size: the experts of a MoE layer are split over this many ranks."""
    etp: int | None = None
    """Expert tensor-parallel size; None means the same as `tp`."""
    first_stage_layers: int | None = None
    """Decoder layers on the first pipeline stage when the layers do not split evenly (None: even split)."""
    last_stage_layers: int | None = None
    """Decoder layers on the last pipeline stage when the layers do not split evenly (None: even split)."""

    @property
    def expert_tp(self) -> int:
        """The effective expert tensor-parallel size."""
        return self.tp if self.etp is None else self.etp

    def __str__(self) -> str:
        parts = [f"tp={self.tp}", f"pp={self.pp}"]
        if self.vpp:
            parts.append(f"vpp={self.vpp}")
        for name in ("cp", "ep"):
            if getattr(self, name) != 1:
                parts.append(f"{name}={getattr(self, name)}")
        if self.etp is not None:
            parts.append(f"etp={self.etp}")
        return " ".join(parts)


def world_size(layout: Layout) -> int:
    """Ranks a layout needs by default: TP x PP x CP x EP (the experts' ranks double as data-parallel replicas)."""
    return layout.tp * layout.pp * layout.cp * layout.ep


def check_world(layout: Layout, world: int) -> None:
    """Raise `LayoutError` unless megatron-core can lay `layout` out over `world` ranks."""
    dense = layout.tp * layout.pp * layout.cp
    expert = layout.expert_tp * layout.ep * layout.pp
    if world < 1 or world % dense or world % expert:
        raise LayoutError(
            f"{world} ranks cannot hold {layout}: the world must be a multiple of tp*pp*cp={dense}"
            f" and of etp*ep*pp={expert}"
        )


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LayoutError(message)


def stage_layer_counts(layout: Layout, num_layers: int) -> list[int]:
    """Decoder layers per pipeline stage, first to last (the virtual stages of a rank are not separated)."""
    pp = layout.pp
    first, last = layout.first_stage_layers, layout.last_stage_layers
    if first is None and last is None:
        return [num_layers // pp] * pp
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    per_middle = rest // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def validate_layout_sizes(layout: Layout) -> None:
    """Refuse sizes below 1 (and stage layer counts below 0), whatever the model."""
    for name in ("tp", "pp", "cp", "ep"):
        value = getattr(layout, name)
        _require(value >= 1, f"{name}={value} must be at least 1")
    _require(layout.vpp is None or layout.vpp >= 1, f"vpp={layout.vpp} must be at least 1")
    _require(layout.etp is None or layout.etp >= 1, f"etp={layout.etp} must be at least 1")
    for name in ("first_stage_layers", "last_stage_layers"):
        value = getattr(layout, name)
        _require(value is None or value >= 0, f"{name}={value} must not be negative")


def validate_layout(layout: Layout, model: ModelSpec) -> None:
    """Refuse a layout that megatron-core cannot build for this model, with the reason."""
    validate_layout_sizes(layout)
    tp = layout.tp
    heads, groups, ffn = model.num_attention_heads, model.num_query_groups, model.ffn_hidden_size
    _require(heads % tp == 0, f"num_attention_heads={heads} is not divisible by tp={tp}")
    _require(groups % tp == 0, f"num_query_groups={groups} is not divisible by tp={tp}")
    _require(ffn % tp == 0, f"ffn_hidden_size={ffn} is not divisible by tp={tp}")
    _validate_pipeline(layout, model.num_layers)
    _validate_experts(layout, model.moe)
    _require(
        layout.cp == 1 or not (model.attention_sinks or model.sliding_window is not None),
        f"cp={layout.cp}: attention sinks and sliding windows are not computed under context parallelism",
    )
    _require(
        layout.cp == 1 or model.linear_attention is None,
        f"cp={layout.cp}: {model.architecture}'s Gated DeltaNet layers are not computed under context parallelism",
    )
    if model.mla is not None:
        _validate_mla(layout, model.mla)


def _validate_experts(layout: Layout, moe: MoeSpec | None) -> None:
    if moe is None:
        _require(layout.ep == 1, f"ep={layout.ep} needs a mixture-of-experts model; this one is dense")
        _require(layout.etp is None, f"etp={layout.etp} needs a mixture-of-experts model; this one is dense")
        return
    _require(moe.num_experts % layout.ep == 0, f"num_experts={moe.num_experts} is not divisible by ep={layout.ep}")
    width = moe.ffn_hidden_size
    _require(width % layout.expert_tp == 0, f"moe_ffn_hidden_size={width} is not divisible by etp={layout.expert_tp}")
    _require(
        not moe.expert_mlp_bias or layout.expert_tp == 1,
        f"etp={layout.expert_tp}: megatron-core holds biased experts (gate_up_proj_bias) only at "
        "expert_tensor_parallel_size 1 (pass etp=1 / --etp 1)",
    )


def _validate_mla(layout: Layout, mla: MlaSpec) -> None:
    """megatron-core's local layer spec splits MLA's down-projections over TP (column-parallel, then gathered)."""
    widths = {"kv_lora_rank + qk_rope_head_dim": mla.kv_lora_rank + mla.qk_rope_head_dim}
    if mla.q_lora_rank is not None:
        widths["q_lora_rank"] = mla.q_lora_rank
    for what, width in widths.items():
        _require(width % layout.tp == 0, f"{what}={width} is not divisible by tp={layout.tp}")


def _validate_pipeline(layout: Layout, num_layers: int) -> None:
    pp, vpp = layout.pp, layout.vpp
    first, last = layout.first_stage_layers, layout.last_stage_layers
    _require(pp <= num_layers, f"pp={pp} is larger than num_layers={num_layers}")
    if first is None and last is None:
        _require(num_layers % pp == 0, f"num_layers={num_layers} is not divisible by pp={pp}")
    else:
        _require(pp > 1, "first/last stage layer counts need pp > 1")
        _require(vpp is None, "uneven first/last pipeline stages cannot be combined with vpp")
        explicit = (first or 0) + (last or 0)
        middle = pp - (first is not None) - (last is not None)
        rest = num_layers - explicit
        _require(rest >= 0, f"first/last stage layers ({explicit}) exceed num_layers={num_layers}")
        if middle:
            _require(
                rest % middle == 0 and rest > 0,
                f"the {rest} layers left after the first/last stages do not split evenly over "
                f"the {middle} middle stages",
            )
        else:
            _require(rest == 0, f"first + last stage layers ({explicit}) must equal num_layers={num_layers}")
    if vpp is not None and vpp > 1:
        _require(pp > 1, f"vpp={vpp} needs pp > 1")
        _require(
            num_layers % (pp * vpp) == 0,
            f"num_layers={num_layers} is not divisible by pp*vpp={pp * vpp}",
        )
