"""The bytes `torch.save` writes around one contiguous tensor, produced without torch, so the data can be copied in.

`torch.save(tensor)` writes a zip archive (stored, not compressed) of seven records: `data.pkl` (the pickled
tensor, its storage a persistent reference), `.format_version`, `.storage_alignment`, `byteorder`, `data/0` (the
raw bytes, starting 64-byte aligned), `version` and `.data/serialization_id`, then the central directory with
zip64 end records. Each record has a local header whose extra field pads the data to the alignment, and a data
descriptor after it. `TensorArchive` computes every byte of that archive except the tensor data: `head` (everything
before the data) and `tail` (everything after), as torch's writer lays them out with its per-record CRC32 turned
off (the CRC fields are zero; readers do not check them). The tests compare the result with `torch.save` byte for
byte, apart from the serialization id, a per-archive random number.

Only what a DCP tensor item needs is covered: one tensor owning its whole storage, contiguous, little-endian,
below 4 GiB (larger records need zip64 extra fields; callers fall back to `torch.save` for those).
"""

from __future__ import annotations

import secrets
import struct
from dataclasses import dataclass
from functools import cached_property

from hf_mcore_bridge.checkpoint.pickles import Call, Global, PersistentId, dumps

STORAGE_TYPES = {
    "float64": ("DoubleStorage", 8),
    "float32": ("FloatStorage", 4),
    "float16": ("HalfStorage", 2),
    "bfloat16": ("BFloat16Storage", 2),
    "int64": ("LongStorage", 8),
    "int32": ("IntStorage", 4),
    "int16": ("ShortStorage", 2),
    "int8": ("CharStorage", 1),
    "uint8": ("ByteStorage", 1),
    "bool": ("BoolStorage", 1),
}
"""dtype name (`str(torch.bfloat16)` without `torch.`) -> (the storage class `torch.save` pickles, element size)."""

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
    storage_type, _ = STORAGE_TYPES[dtype]
    numel = _numel(shape)
    storage = PersistentId(("storage", Global("torch", storage_type), "0", "cpu", numel))
    strides = _contiguous_strides(shape)
    hooks = Call(Global("collections", "OrderedDict"), ())
    return dumps(Call(Global("torch._utils", "_rebuild_tensor_v2"), (storage, 0, shape, strides, False, hooks)))


def supported(dtype: str, nbytes: int) -> bool:
    """Whether `TensorArchive` can frame a tensor of this dtype and data size."""
    return dtype in STORAGE_TYPES and 0 < nbytes < _LIMIT - 2**20  # room for the records around the data


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
        return _numel(self.shape) * STORAGE_TYPES[self.dtype][1]

    @cached_property
    def _layout(self) -> tuple[bytes, bytes]:
        ident = self.serialization_id or f"{secrets.randbits(64):020d}{secrets.randbits(64):020d}"
        records = [
            ("data.pkl", tensor_pickle(self.dtype, self.shape)),
            (".format_version", b"1"),
            (".storage_alignment", str(ALIGNMENT).encode()),
            ("byteorder", b"little"),
            ("data/0", None),
            ("version", b"3\n"),
            (".data/serialization_id", ident.encode()),
        ]
        head, tail = bytearray(), bytearray()
        out, offset = head, 0
        central: list[tuple[str, int, int]] = []
        for name, content in records:
            full = _PREFIX + name
            length = self.data_length if content is None else len(content)
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
            _CENTRAL.pack(b"PK\x01\x02", 0, 0, _FLAGS, 0, 0, 0, 0, n, n, len(f.encode()), 0, 0, 0, 0, 0, at)
            + f.encode()
            for f, at, n in central
        )
        count = len(central)
        tail += directory
        tail += _ZIP64_END.pack(b"PK\x06\x06", 44, 0x031E, 45, 0, 0, count, count, len(directory), offset)
        tail += _ZIP64_LOCATOR.pack(b"PK\x06\x07", 0, offset + len(directory), 1)
        tail += _END.pack(b"PK\x05\x06", 0, 0, count, count, len(directory), offset, 0)
        return bytes(head), bytes(tail)

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
