"""Tensor element types by name, without importing torch: what checkpoint files store and conversions plan in.

A conversion decides every tensor's dtype, size and place from file headers (safetensors' JSON, DCP's
`.metadata`) before it moves a byte, and a conversion that casts nothing copies the bytes without ever holding a
tensor; importing torch would cost it more than the copy. So the planning code speaks of `DType`s: one per element
type, with the names each format gives it (torch's `bfloat16`, safetensors' `BF16`, the storage class
`BFloat16Storage` that `torch.save` pickles) and its size. Code that makes tensors asks a `DType` for torch's
dtype (`.torch`, which imports torch then) and turns a tensor's dtype back with `of`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DType:
    """One element type."""

    name: str
    """torch's name (`torch.bfloat16` is `bfloat16`)."""
    itemsize: int
    """Bytes per element."""
    safetensors: str
    """The safetensors header's name (`BF16`)."""
    storage: str | None
    """The storage class `torch.save` pickles for it (None: not written by this project's archive writer)."""
    floating: bool

    @property
    def torch(self) -> torch.dtype:
        """torch's dtype object (imports torch)."""
        import torch

        return getattr(torch, self.name)

    def __str__(self) -> str:
        return self.name


FLOAT64 = DType("float64", 8, "F64", "DoubleStorage", True)
FLOAT32 = DType("float32", 4, "F32", "FloatStorage", True)
FLOAT16 = DType("float16", 2, "F16", "HalfStorage", True)
BFLOAT16 = DType("bfloat16", 2, "BF16", "BFloat16Storage", True)
FLOAT8_E4M3 = DType("float8_e4m3fn", 1, "F8_E4M3", None, True)
INT64 = DType("int64", 8, "I64", "LongStorage", False)
INT32 = DType("int32", 4, "I32", "IntStorage", False)
INT16 = DType("int16", 2, "I16", "ShortStorage", False)
INT8 = DType("int8", 1, "I8", "CharStorage", False)
UINT8 = DType("uint8", 1, "U8", "ByteStorage", False)
BOOL = DType("bool", 1, "BOOL", "BoolStorage", False)

ALL = (FLOAT64, FLOAT32, FLOAT16, BFLOAT16, FLOAT8_E4M3, INT64, INT32, INT16, INT8, UINT8, BOOL)
BY_NAME = {d.name: d for d in ALL}
"""torch's names -> dtypes."""
BY_SAFETENSORS = {d.safetensors: d for d in ALL}
"""safetensors' names -> dtypes."""
BY_STORAGE = {d.storage: d for d in ALL if d.storage is not None}
"""`torch.save`'s storage class names -> dtypes."""

FLAGS = {"fp32": FLOAT32, "bf16": BFLOAT16, "fp16": FLOAT16}
"""The command line's dtype choices (`--dtype`)."""


def of(dtype: Any) -> DType:
    """The `DType` of a torch dtype (or of a `DType`, unchanged); a ValueError for one this module does not know."""
    if isinstance(dtype, DType):
        return dtype
    found = BY_NAME.get(str(dtype).removeprefix("torch."))
    if found is None:
        raise ValueError(f"unsupported dtype {dtype}")
    return found
