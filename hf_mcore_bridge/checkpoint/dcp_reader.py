"""Reading torch.distributed.checkpoint (DCP) directories without a process group and without trusting pickles.

The `.metadata` file is a pickle: it is read with an unpickler that resolves only DCP's own metadata classes,
`torch.Size`, dtypes and `PosixPath`; anything else is refused. `DCPCheckpoint` reads it into stand-ins for
those classes (`dcp_metadata`), so that reading a checkpoint does not import torch.distributed.checkpoint (most of
a second); `read_metadata` gives DCP's own classes, for handing to DCP's loader. Data items are `torch.save`
payloads, read with `torch.load(weights_only=True)`. A region of a global tensor is assembled from the chunks
that overlap it, so a checkpoint written at any layout can be read at any granularity, one chunk at a time.

A tensor item is a `torch.save` zip archive (stored, not compressed) at an offset of a `.distcp` file. When its
`data.pkl` describes one contiguous little-endian storage holding exactly the chunk (read with an unpickler that
resolves nothing but the names a tensor's pickle uses), the chunk's bytes are read straight into the destination
tensor (`readinto`), without the intermediate copies of `torch.load`; any other item goes through `torch.load`.
`raw_chunks` gives where those bytes are, for copying them without reading them (`byte_copy`).
"""

from __future__ import annotations

import io
import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.dcp_metadata import (
    DTYPE_NAMES,
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    MetadataUnpickler,
    TensorStorageMetadata,
)
from hf_mcore_bridge.checkpoint.plain_load import member_start
from hf_mcore_bridge.errors import CheckpointError

if TYPE_CHECKING:
    import torch

_ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "BytesStorageMetadata",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo", "_StoragePrefix"},
    # megatron-core's save strategy caches each rank's plan in the metadata (`all_local_plans`)
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size", *DTYPE_NAMES},
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name} from a checkpoint's .metadata")


def read_metadata(directory: Path) -> Any:
    """The DCP metadata of a checkpoint directory as DCP's own `Metadata`, unpickled with an allow-list."""
    from torch.distributed.checkpoint.metadata import Metadata as DCPMetadata

    return _read(directory, _MetadataUnpickler, DCPMetadata)


def _read(directory: Path, unpickler: type[pickle.Unpickler], expected: type) -> Any:
    path = directory / ".metadata"
    if not path.exists():
        raise CheckpointError(f"{directory} is not a distributed checkpoint (no .metadata)")
    try:
        with path.open("rb") as handle:
            metadata = unpickler(handle).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from None
    if not isinstance(metadata, expected):
        raise CheckpointError(f"{path} does not hold DCP metadata")
    return metadata


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor as the checkpoint stores it."""

    key: str
    shape: tuple[int, ...]
    dtype: dtypes.DType
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


class DCPCheckpoint:
    """A DCP directory opened for reading: metadata validated, data files checked for size."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.metadata: Metadata = _read(self.directory, MetadataUnpickler, Metadata)
        self._meta: dict[str, TensorMeta] = {}
        self._check_files()

    def _check_files(self) -> None:
        needed: dict[str, int] = {}
        for info in self.metadata.storage_data.values():
            if getattr(info, "transform_descriptors", None):
                raise CheckpointError(f"{info.relative_path} uses storage transforms, which are not supported")
            needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        for name, size in needed.items():
            path = self.directory / name
            if not path.exists():
                raise CheckpointError(f"{self.directory} lacks data file {name}")
            actual = path.stat().st_size
            if actual < size:
                raise CheckpointError(f"{path} is truncated: {actual} bytes, the metadata needs {size}")

    def tensor_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]

    def object_keys(self) -> list[str]:
        return [k for k, v in self.metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)]

    def tensor_meta(self, key: str) -> TensorMeta:
        meta = self._meta.get(key)
        if meta is None:
            entry = self.metadata.state_dict_metadata.get(key)
            if not isinstance(entry, TensorStorageMetadata):
                raise CheckpointError(f"tensor {key} is missing from {self.directory}")
            chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
            meta = self._meta[key] = TensorMeta(key, tuple(entry.size), entry.properties.dtype, chunks)
        return meta

    def location(self, key: str) -> Path:
        """The data file holding a tensor's first chunk (or the metadata file when it has none)."""
        for index, info in self.metadata.storage_data.items():  # only called for messages
            if index.fqn == key:
                return self.directory / info.relative_path
        return self.directory / ".metadata"

    def _item_bytes(self, index: MetadataIndex) -> bytes:
        info = self.metadata.storage_data[index]
        path = self.directory / info.relative_path
        try:
            with path.open("rb") as handle:
                handle.seek(info.offset)
                payload = handle.read(info.length)
        except OSError as err:
            raise CheckpointError(f"reading {index.fqn} from {path} failed: {err.strerror or err}") from None
        if len(payload) != info.length:
            raise CheckpointError(f"{path} is truncated: {index.fqn} needs bytes up to {info.offset + info.length}")
        return payload

    def read_bytes(self, key: str) -> bytes:
        """The stored bytes of a non-tensor item (a `torch.save` payload), for a caller that unpickles it with
        its own allow-list."""
        if key not in self.object_keys():
            raise CheckpointError(f"{self.directory} has no item {key}")
        return self._item_bytes(MetadataIndex(key))

    def _load_item(self, index: MetadataIndex) -> Any:
        import torch

        payload = self._item_bytes(index)
        info = self.metadata.storage_data[index]
        try:
            return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{index.fqn} in {info.relative_path} is unreadable: {err}") from None

    def _read_chunk(
        self, index: MetadataIndex, sizes: tuple[int, ...], dtype: dtypes.DType, into: torch.Tensor | None = None
    ) -> torch.Tensor:
        """A tensor item, read in place where its layout allows (into `into`, a contiguous tensor of `sizes`, when
        given), else through `torch.load`."""
        import torch

        info = self.metadata.storage_data[index]
        path = self.directory / info.relative_path
        try:
            with path.open("rb") as handle:
                start = _plain_tensor_data(handle, info.offset, info.length, sizes, dtype)
                if start is not None:
                    out = into if into is not None else torch.empty(sizes, dtype=dtype.torch)
                    handle.seek(info.offset + start)
                    if handle.readinto(_byte_view(out)) == out.numel() * out.element_size():
                        return out
        except OSError as err:
            raise CheckpointError(f"reading {index.fqn} from {path} failed: {err.strerror or err}") from None
        data = self._load_item(index)
        if not isinstance(data, torch.Tensor) or tuple(data.shape) != sizes:
            raise CheckpointError(f"{index.fqn} in {info.relative_path} is not a tensor of shape {sizes}")
        return data

    def raw_chunks(self, key: str) -> list[tuple[tuple[int, ...], tuple[int, ...], Path, int]] | None:
        """Each chunk of a tensor as (offsets, sizes, data file, where its raw bytes start), when every chunk is
        stored as plain row-major little-endian bytes; None otherwise."""
        meta = self.tensor_meta(key)
        found = []
        for offsets, sizes in meta.chunks:
            info = self.metadata.storage_data[MetadataIndex(key, offsets)]
            path = self.directory / info.relative_path
            try:
                with path.open("rb") as handle:
                    start = _plain_tensor_data(handle, info.offset, info.length, sizes, meta.dtype)
            except OSError as err:
                raise CheckpointError(f"reading {key} from {path} failed: {err.strerror or err}") from None
            if start is None:
                return None
            found.append((offsets, sizes, path, info.offset + start))
        return found

    def read_object(self, key: str) -> Any:
        """A non-tensor item (megatron ShardedObject payload)."""
        return self._load_item(MetadataIndex(key))

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None):
        """The region [offsets, offsets + sizes) of a global tensor (the whole tensor by default)."""
        import torch

        meta = self.tensor_meta(key)
        offsets = offsets or (0,) * len(meta.shape)
        sizes = sizes or meta.shape
        out = torch.empty(sizes, dtype=meta.dtype.torch)
        covered = 0
        for chunk_offsets, chunk_sizes in meta.chunks:
            overlap = _overlap(offsets, sizes, chunk_offsets, chunk_sizes)
            if overlap is None:
                continue
            src = tuple(slice(lo - c, hi - c) for (lo, hi), c in zip(overlap, chunk_offsets, strict=True))
            dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(overlap, offsets, strict=True))
            index = MetadataIndex(key, chunk_offsets)
            target = out[dst]
            if _volume(overlap) == _numel(chunk_sizes) and target.is_contiguous():
                # the whole chunk lands in one contiguous block of `out` (chunks split on leading axes)
                data = self._read_chunk(index, chunk_sizes, meta.dtype, into=target.view(chunk_sizes))
                if data.data_ptr() != target.data_ptr():
                    target.copy_(data.view(target.shape))
            else:
                data = self._read_chunk(index, chunk_sizes, meta.dtype)
                target.copy_(data[src])
            covered += _volume(overlap)
            del data
        if covered != _volume(tuple((o, o + s) for o, s in zip(offsets, sizes, strict=True))):
            raise CheckpointError(f"the chunks of {key} do not cover the region {offsets}+{sizes}")
        return out


def _overlap(offsets, sizes, chunk_offsets, chunk_sizes) -> tuple[tuple[int, int], ...] | None:
    bounds = []
    for o, s, co, cs in zip(offsets, sizes, chunk_offsets, chunk_sizes, strict=True):
        lo, hi = max(o, co), min(o + s, co + cs)
        if lo >= hi:
            return None
        bounds.append((lo, hi))
    return tuple(bounds)


def _volume(bounds: tuple[tuple[int, int], ...]) -> int:
    volume = 1
    for lo, hi in bounds:
        volume *= hi - lo
    return volume


class _Region(io.RawIOBase):
    """A read-only window [start, start + length) of an open file, for `zipfile` to parse one DCP item."""

    def __init__(self, handle: Any, start: int, length: int):
        self._handle, self._start, self._length, self._pos = handle, start, length, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self._pos = pos if whence == 0 else self._pos + pos if whence == 1 else self._length + pos
        return self._pos

    def read(self, size: int = -1) -> bytes:
        size = self._length - self._pos if size is None or size < 0 else min(size, self._length - self._pos)
        self._handle.seek(self._start + self._pos)
        data = self._handle.read(max(size, 0))
        self._pos += len(data)
        return data


class _TensorPickle(pickle.Unpickler):
    """Reads a tensor's `data.pkl` into plain tuples: it resolves only the rebuild function and storage types."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda *args: ("tensor", *args)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage"):
            return name
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        return tuple(pid)


def _plain_tensor_data(handle: Any, start: int, length: int, sizes: tuple[int, ...], dtype: dtypes.DType) -> int | None:
    """The offset (within the item) of the chunk's raw bytes when the item stores exactly `sizes` x `dtype`
    contiguously from offset 0 of one little-endian storage; None when it does not (or is not a plain tensor)."""
    region = _Region(handle, start, length)
    try:
        members = {z.filename: z for z in zipfile.ZipFile(region).infolist()}
        pkl = next(z for name, z in members.items() if name.endswith("/data.pkl"))
        prefix = pkl.filename[: -len("data.pkl")]
        order = members.get(f"{prefix}byteorder")
        if any(z.compress_type != zipfile.ZIP_STORED for z in (pkl, order) if z is not None):
            return None
        if order is not None:
            region.seek(member_start(region, order))
            if region.read(order.file_size) != b"little":
                return None
        region.seek(member_start(region, pkl))
        kind, storage, storage_offset, size, stride = _TensorPickle(io.BytesIO(region.read(pkl.file_size))).load()[:5]
        _, storage_type, key, _, numel = storage
        if kind != "tensor" or dtypes.BY_STORAGE.get(storage_type) != dtype or storage_offset != 0:
            return None
        if tuple(size) != sizes or tuple(stride) != _contiguous_strides(sizes) or numel != _numel(sizes):
            return None
        data = members.get(f"{prefix}data/{key}")
        if data is None or data.compress_type != zipfile.ZIP_STORED:
            return None
        if data.file_size != _numel(sizes) * dtype.itemsize:
            return None
        return member_start(region, data)
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, ValueError, TypeError, EOFError, AttributeError):
        return None


def _numel(sizes: tuple[int, ...]) -> int:
    count = 1
    for dim in sizes:
        count *= dim
    return count


def _contiguous_strides(sizes: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(sizes):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
