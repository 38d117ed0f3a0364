"""The public bridge API: an HF model as megatron-core sees it, and its weights into and out of a live model.

`AutoBridge` (`auto`) is the entry point: `from_pretrained` (a directory or a Hub id), then `transformer_config`,
`layer_spec`, `model_provider`, `get_model`, `load_hf_weights`, `export_hf_weights` (and `_bucketed`) and `save_hf`.
The functions below are the same calls for one-off use, given the HF directory (or Hub id) the model was built
from; a loop that exports after every step keeps one `AutoBridge` instead (each call here reads the config again).
Module layout: `plan` (which local tensor holds which table entry), `load`, `export`, `save`.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.bridge.auto import AutoBridge

if TYPE_CHECKING:
    import torch

__all__ = ["AutoBridge", "export_hf_weights", "export_hf_weights_bucketed", "load_hf_weights", "save_hf"]

Source = str | os.PathLike[str]
"""An HF directory or a Hub repo id."""


def load_hf_weights(models: Any, hf_dir: Source) -> None:
    """`AutoBridge.load_hf_weights`: fill `models` (a `GPTModel` or its virtual-pipeline chunks) from `hf_dir`,
    each rank reading only its slices."""
    AutoBridge.from_pretrained(hf_dir).load_hf_weights(models)


def export_hf_weights(models: Any, source: Source, **options: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """`AutoBridge.export_hf_weights` of a model built from `source`: `(hf_name, full tensor)` on every rank."""
    return AutoBridge.from_pretrained(source).export_hf_weights(models, **options)


def export_hf_weights_bucketed(
    models: Any, source: Source, bucket_bytes: int = 512 << 20, **options: Any
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """`AutoBridge.export_hf_weights_bucketed` of a model built from `source`."""
    return AutoBridge.from_pretrained(source).export_hf_weights_bucketed(models, bucket_bytes, **options)


def save_hf(models: Any, out_dir: Source, source: Source, **options: Any) -> Path:
    """`AutoBridge.save_hf` of a model built from `source` (whose tokenizer and config are written with it)."""
    return AutoBridge.from_pretrained(source).save_hf(models, out_dir, **options)
