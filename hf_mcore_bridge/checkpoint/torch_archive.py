"""The bytes `torch.save` writes around one contiguous tensor, produced without torch, so the data can be copied in.

`torch.save(tensor)` writes a zip archive (stored, not compressed) of seven records: `data.pkl` (the pickled
tensor, its storage a persistent reference), `.format_version`, `.storage_alignment`, `byteorder`, `data/0` (the
raw bytes, starting 64-byte aligned), `version` and `.data/serialization_id`, then the central directory with
zip64 end records. Each record has a local header whose extra field pads the data to the alignment, and a data
descriptor after it. `TensorArchive` computes every byte of that archive except the tensor data: `head` (everything
before the data) and `tail` (everything after), as torch's writer lays them out with its per-record CRC32 turned
off (the CRC fields are zero; readers do not check them). The tests compare the result with `torch.save` byte for
byte, apart from the serialization id, a per-archive random number, and so does every conversion against the
installed torch before it writes (`writer_contract`), falling back to `torch.save` where they differ.

Only what a DCP tensor item needs is covered: one tensor owning its whole storage, contiguous, little-endian,
below 4 GiB (larger records need zip64 extra fields; callers fall back to `torch.save` for those). `saved_plain`
writes the same archive, without a data record, for a value that holds no tensors (Megatron-LM's common state),
so a conversion that casts nothing needs no torch to write one.
"""

from __future__ import annotations

import argparse
import pathlib
import secrets
import struct
import types
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from hf_mcore_bridge.checkpoint.dtypes import BY_NAME, DType
from hf_mcore_bridge.checkpoint.pickles import Call, Global, New, PersistentId, dumps

ALIGNMENT = 64
"""Where `torch.save` starts each record's data (torch.utils.serialization.config.save.storage_alignment)."""

_LIMIT = 0xFFFFFFFF
_PREFIX = "archive/"
_LOCAL = struct.Struct("<4sHHHHHIIIHH")
_DESCRIPTOR = struct.Struct("<4sIII")
_CENTRAL = struct.Struct("<4sHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<4sQHHIIQQQQ")
_ZIP64_LOCATOR = struct.Struct("<4sIQI")
_END = struct.Struct("<4sHHHHIIH")
_FLAGS = 0x0808
"""Data descriptor follows (bit 3), names are UTF-8 (bit 11): what torch's miniz writer sets."""


def tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """`data.pkl` of a contiguous tensor of `shape` owning storage `0` on the CPU, as `torch.save` pickles it."""
    storage_type = BY_NAME[dtype].storage
    numel = _numel(shape)
    storage = PersistentId(("storage", Global("torch", storage_type), "0", "cpu", numel))
    strides = _contiguous_strides(shape)
    hooks = Call(Global("collections", "OrderedDict"), ())
    return dumps(Call(Global("torch._utils", "_rebuild_tensor_v2"), (storage, 0, shape, strides, False, hooks)))


def supported(dtype: str, nbytes: int) -> bool:
    """Whether `TensorArchive` can frame a tensor of this dtype and data size."""
    known = BY_NAME.get(dtype)
    fits = 0 < nbytes < _LIMIT - 2**20  # room for the records around the data
    return known is not None and known.storage is not None and fits


@dataclass(frozen=True)
class TensorArchive:
    """The `torch.save` archive of one contiguous tensor, less its data bytes."""

    dtype: str
    """dtype name, e.g. `bfloat16`."""
    shape: tuple[int, ...]
    serialization_id: str = ""
    """40 decimal digits; a random one when empty."""

    @property
    def data_length(self) -> int:
        return _numel(self.shape) * BY_NAME[self.dtype].itemsize

    @cached_property
    def _layout(self) -> tuple[bytes, bytes]:
        return _archive(tensor_pickle(self.dtype, self.shape), self.data_length, self.serialization_id)

    @property
    def head(self) -> bytes:
        """The archive's bytes before the tensor data (which starts `ALIGNMENT`-aligned within the archive)."""
        return self._layout[0]

    @property
    def tail(self) -> bytes:
        """The archive's bytes after the tensor data."""
        return self._layout[1]

    @property
    def length(self) -> int:
        """The archive's size in bytes."""
        return len(self.head) + self.data_length + len(self.tail)


def saved_plain(value: Any, serialization_id: str = "") -> bytes:
    """The `torch.save` archive of a value without tensors: plain values, argparse namespaces and dtypes (as
    `dtypes.DType`s, pickled as torch's), e.g. Megatron-LM's common state. A TypeError names anything else."""
    return b"".join(_archive(dumps(_by_name(value)), None, serialization_id))


def _by_name(value: Any) -> Any:
    """`value` with the objects the standard pickler writes by class rebuilt as `pickles` values."""
    if isinstance(value, DType):
        return Global("torch", value.name)
    if isinstance(value, argparse.Namespace | types.SimpleNamespace):
        cls, state = (
            Global(type(value).__module__, type(value).__qualname__),
            {k: _by_name(v) for k, v in vars(value).items()},
        )
        # a SimpleNamespace reduces to (its class, (), its vars); a Namespace is rebuilt by __new__ and its vars
        return Call(cls, (), state) if isinstance(value, types.SimpleNamespace) else New(cls, state)
    if type(value) is pathlib.PosixPath:
        return Call(Global("pathlib", "PosixPath"), tuple(value.parts))
    if type(value) in (list, tuple):
        return type(value)(_by_name(v) for v in value)
    if type(value) is dict:
        return {k: _by_name(v) for k, v in value.items()}
    if value is None or type(value) in (bool, int, float, str):
        return value
    raise TypeError(f"cannot write {type(value).__name__} into a torch.save archive without torch")


def _archive(pickled: bytes, data_length: int | None, serialization_id: str) -> tuple[bytes, bytes]:
    """(head, tail) of the archive around the data record `data/0` of `data_length` bytes (head: the whole archive
    and tail empty, with no data record)."""
    ident = serialization_id or f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}"
    records = [
        ("data.pkl", pickled),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", b"little"),
        *([("data/0", None)] if data_length is not None else []),
        ("version", b"3\n"),
        (".data/serialization_id", ident.encode()),
    ]
    head, tail = bytearray(), bytearray()
    out, offset = head, 0
    central: list[tuple[str, int, int]] = []
    for name, content in records:
        full = _PREFIX + name
        length = (data_length or 0) if content is None else len(content)
        local = _local_header(full, offset)
        out += local
        central.append((full, offset, length))
        if content is None:
            out = tail  # the tensor's bytes go between head and tail
        else:
            out += content
        out += _DESCRIPTOR.pack(b"PK\x07\x08", 0, length, length)
        offset += len(local) + length + _DESCRIPTOR.size
    directory = b"".join(
        _CENTRAL.pack(b"PK\x01\x02", 0, 0, _FLAGS, 0, 0, 0, 0, n, n, len(f.encode()), 0, 0, 0, 0, 0, at) + f.encode()
        for f, at, n in central
    )
    count = len(central)
    out += directory
    out += _ZIP64_END.pack(b"PK\x06\x06", 44, 0x031E, 45, 0, 0, count, count, len(directory), offset)
    out += _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, offset + len(directory), 1)
    out += _END.pack(b"PK\x05\x06", 0, 0, count, count, len(directory), offset, 0)
    return bytes(head), bytes(tail)


def _local_header(name: str, offset: int) -> bytes:
    encoded = name.encode()
    start = offset + _LOCAL.size + len(encoded) + 4  # the data would start here with an empty padding field
    padding = -start % ALIGNMENT
    extra = b"FB" + struct.pack("<H", padding) + b"Z" * padding
    return _LOCAL.pack(b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), len(extra)) + encoded + extra


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))
