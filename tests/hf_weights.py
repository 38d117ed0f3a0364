"""Comparing HF checkpoints tensor by tensor: the same names, dtypes and values (`torch.equal`)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def read_weights(directory: Path) -> dict[str, torch.Tensor]:
    """The tensors of every safetensors file of an HF directory, by name."""
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def assert_same_weights(original: Path, exported: Path) -> None:
    a, b = read_weights(original), read_weights(exported)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
