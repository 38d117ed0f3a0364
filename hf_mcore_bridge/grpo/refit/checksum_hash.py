"""The constants of the refit checksum's hash (`refit.checksums` states the hash), and the row layout of a batch's
buffer: what both its torch path (`refit.checksums`) and its Triton kernels (`refit.checksum_kernel`) read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["CHECKSUM_LANES", "MIXERS", "Mixer", "RowLayout"]

CHECKSUM_LANES = 4096
"""Elements per row of a batch's buffer (the small tensors' path): a tensor occupies whole rows of it."""


@dataclass(frozen=True)
class Mixer:
    """The constants of one column of the hash: odd multipliers below 2^32 and F's middle shift."""

    a: int
    b: int
    m1: int
    shift: int
    m2: int


MIXERS = (
    Mixer(a=0x9E3779B1, b=0x85EBCA77, m1=0x85EBCA6B, shift=13, m2=0xC2B2AE35),
    Mixer(a=0xC2B2AE3D, b=0x27D4EB2F, m1=0x7FEB352D, shift=15, m2=0x846CA68B),
)
"""Column 0 and column 1: position constants a, b and the finaliser of MurmurHash3 (column 0) and of "lowbias32"
(column 1)."""


@dataclass(frozen=True)
class RowLayout:
    """Per row of a batch's buffer: the row's index within its tensor, its count of elements (the rest is padding)
    and the index of its tensor in the call's output ([rows] int64 each, on the device)."""

    within: torch.Tensor
    counts: torch.Tensor
    owner: torch.Tensor
