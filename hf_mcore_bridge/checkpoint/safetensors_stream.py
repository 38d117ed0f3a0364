"""Writing safetensors files tensor by tensor, with the header written first from a declared plan.

The `safetensors` library writes a file from a dict of tensors held in memory; exporting a large model that way
would hold a whole shard (gigabytes). The format is simple (an 8-byte little-endian header length, a JSON header
of names, dtypes, shapes and byte ranges, then the raw bytes), so when every tensor's name, shape and dtype are
known up front the header can be written first and the data streamed after it (`SafetensorsStreamWriter`), or
every tensor's bytes written at its place by whoever has them (`SafetensorsLayout` gives the header and the
places). Files are read back with the `safetensors` library in the tests.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from hf_mcore_bridge.checkpoint import dtypes

if TYPE_CHECKING:
    import torch

Plan = list[tuple[str, tuple[int, ...], Any]]
"""(name, shape, dtype) of each tensor in file order; a dtype is a `dtypes.DType` or a `torch.dtype`."""


class SafetensorsLayout:
    """The header of a safetensors file holding tensors of the given names, shapes and dtypes in this order, and
    where in the file each tensor's bytes go."""

    def __init__(self, plan: Plan, metadata=None):
        header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
        ranges: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, shape, given in plan:
            dtype = dtypes.of(given)
            size = dtype.itemsize
            for dim in shape:
                size *= dim
            header[name] = {"dtype": dtype.safetensors, "shape": list(shape), "data_offsets": [offset, offset + size]}
            ranges[name] = (offset, size)
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned, as the library writes it
        self.header = struct.pack("<Q", len(encoded)) + encoded
        """The file's first bytes: the header's length and the header."""
        self._ranges = {name: (len(self.header) + start, size) for name, (start, size) in ranges.items()}

    def place(self, name: str) -> tuple[int, int]:
        """(offset in the file, length) of a tensor's bytes."""
        return self._ranges[name]


class SafetensorsStreamWriter:
    """One safetensors file whose tensors are declared up front and then written in the declared order."""

    def __init__(self, path: Path, plan: Plan, metadata=None):
        self.path = path
        self._order = [name for name, _, _ in plan]
        self._specs = {name: (shape, dtypes.of(dtype)) for name, shape, dtype in plan}
        self._handle: BinaryIO = path.open("wb")
        self._handle.write(SafetensorsLayout(plan, metadata).header)
        self._next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Write the next declared tensor."""
        expected = self._order[self._next] if self._next < len(self._order) else None
        if name != expected:
            raise AssertionError(f"{self.path.name}: got {name}, expected {expected}")
        import torch

        shape, dtype = self._specs[name]
        if tuple(tensor.shape) != shape or dtypes.of(tensor.dtype) != dtype:
            raise AssertionError(f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, declared {shape} {dtype}")
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8)
        self._handle.write(memoryview(data.numpy()))
        self._next += 1

    @property
    def complete(self) -> bool:
        return self._next == len(self._order)

    def close(self) -> None:
        """Close the file after every declared tensor was written."""
        self._handle.close()
        if not self.complete:
            raise AssertionError(f"{self.path.name}: {len(self._order) - self._next} declared tensors never written")

    def abandon(self) -> None:
        """Close the file, complete or not: after a failure the caller reports that failure, not this file."""
        self._handle.close()
