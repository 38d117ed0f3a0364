"""Parallel layouts (TP/PP/VPP/CP/EP/ETP) and their validation against a model's shape.

A layout is a property of how megatron-core will run the model; the distributed checkpoint itself stores global
tensors and loads at any layout. The layout still matters for conversion: it pads the vocabulary, chunks tensors
the way the target ranks will read them, and is recorded in the checkpoint's `args`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hf_mcore_bridge.errors import LayoutError


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


def validate_layout(
    layout: Layout,
    *,
    num_layers: int,
    num_attention_heads: int,
    num_query_groups: int,
    ffn_hidden_size: int,
    num_experts: int | None = None,
    moe_ffn_hidden_size: int | None = None,
) -> None:
    """Refuse a layout that megatron-core cannot build for this model, with the reason."""
    validate_layout_sizes(layout)
    tp = layout.tp
    _require(
        num_attention_heads % tp == 0,
        f"num_attention_heads={num_attention_heads} is not divisible by tp={tp}",
    )
    _require(num_query_groups % tp == 0, f"num_query_groups={num_query_groups} is not divisible by tp={tp}")
    _require(ffn_hidden_size % tp == 0, f"ffn_hidden_size={ffn_hidden_size} is not divisible by tp={tp}")
    _validate_pipeline(layout, num_layers)
    if num_experts is None:
        _require(layout.ep == 1, f"ep={layout.ep} needs a mixture-of-experts model; this one is dense")
        _require(layout.etp is None, f"etp={layout.etp} needs a mixture-of-experts model; this one is dense")
        return
    _require(num_experts % layout.ep == 0, f"num_experts={num_experts} is not divisible by ep={layout.ep}")
    if moe_ffn_hidden_size is not None:
        _require(
            moe_ffn_hidden_size % layout.expert_tp == 0,
            f"moe_ffn_hidden_size={moe_ffn_hidden_size} is not divisible by etp={layout.expert_tp}",
        )


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


_EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""HF config keys that hold the routed-expert count (Mixtral; Qwen-MoE; DeepSeek-style); a config with none of them
is a dense model. A mixture-of-experts family with another key must add it here."""


def validate_layout_for_hf_config(layout: Layout, config: Mapping[str, Any]) -> None:
    """`validate_layout` from an HF `config.json` read as plain JSON: a cheap check before anything heavy loads.

    Checks the layers, heads, query groups and FFN width the config states, and EP/ETP against the expert count
    (`_EXPERT_COUNT_KEYS`); a value the config lacks is left to the full conversion to report.
    Sizes below 1 are refused whatever the config says.
    """

    def count(key: str, default: int | None = None) -> int | None:
        value = config.get(key, default)
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None

    validate_layout_sizes(layout)
    heads = count("num_attention_heads")
    layers, ffn = count("num_hidden_layers"), count("intermediate_size")
    if heads is None or layers is None or ffn is None:
        return  # the full conversion names the missing or malformed key
    experts = next((n for key in _EXPERT_COUNT_KEYS if (n := count(key)) is not None), None)
    validate_layout(
        layout,
        num_layers=layers,
        num_attention_heads=heads,
        num_query_groups=count("num_key_value_heads") or heads,
        ffn_hidden_size=ffn,
        num_experts=experts,
    )
