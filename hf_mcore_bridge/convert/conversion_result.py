"""What a conversion reports when it is done: where it wrote, the model and layout, how many tensors and bytes."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.models.spec import ModelSpec


@dataclass(frozen=True)
class ConversionResult:
    """What a conversion wrote."""

    destination: Path
    model: ModelSpec
    layout: Layout
    tensors: int
    bytes_written: int
    seconds: float
    notes: tuple[str, ...] = ()
    """One-line notices for the user (e.g. that a checkpoint of mixed dtypes was cast to one)."""
