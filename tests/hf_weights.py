"""Comparing HF checkpoints tensor by tensor: the same names, dtypes and values (`torch.equal`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


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


def scaled_copy(source: Path, destination: Path, suffixes: tuple[str, ...], factor: float) -> Path:
    """A copy of an HF directory with every tensor whose name ends with one of `suffixes` multiplied by `factor`
    (a purpose-built model: e.g. small latents, where multi-latent attention's norm epsilon matters)."""
    shutil.copytree(source, destination)
    found = 0
    for file in sorted(destination.glob("*.safetensors")):
        tensors = load_file(file)
        found += sum(name.endswith(suffixes) for name in tensors)
        save_file({n: t * factor if n.endswith(suffixes) else t for n, t in tensors.items()}, file, {"format": "pt"})
    assert found, f"no tensor of {source} ends with {suffixes}"
    return destination
