"""Reading torch.distributed.checkpoint (DCP) directories without a process group and without trusting pickles.

The `.metadata` file is a pickle: it is read with an unpickler that resolves only DCP's own metadata classes,
`torch.Size`, dtypes and `PosixPath`; anything else is refused. Data items are `torch.save` payloads, read with
`torch.load(weights_only=True)`. A region of a global tensor is assembled from the chunks that overlap it, so a
checkpoint written at any layout can be read at any granularity, one chunk at a time.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from hf_mcore_bridge.errors import CheckpointError

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
    "torch": {
        "Size",
        *(
            str(d).removeprefix("torch.")
            for d in (
                torch.float64,
                torch.float32,
                torch.float16,
                torch.bfloat16,
                torch.int64,
                torch.int32,
                torch.int16,
                torch.int8,
                torch.uint8,
                torch.bool,
            )
        ),
    },
    "pathlib": {"PosixPath", "PurePosixPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise CheckpointError(f"refusing to unpickle {module}.{name} from a checkpoint's .metadata")


def read_metadata(directory: Path) -> Metadata:
    """The DCP metadata of a checkpoint directory, unpickled with an allow-list."""
    path = directory / ".metadata"
    if not path.exists():
        raise CheckpointError(f"{directory} is not a distributed checkpoint (no .metadata)")
    try:
        with path.open("rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{path} does not hold DCP metadata")
    return metadata


@dataclass(frozen=True)
class TensorMeta:
    """A global tensor as the checkpoint stores it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


class DCPCheckpoint:
    """A DCP directory opened for reading: metadata validated, data files checked for size."""

    def __init__(self, directory: Path | str):
        self.directory = Path(directory)
        self.metadata = read_metadata(self.directory)
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
        entry = self.metadata.state_dict_metadata.get(key)
        if not isinstance(entry, TensorStorageMetadata):
            raise CheckpointError(f"tensor {key} is missing from {self.directory}")
        chunks = tuple((tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks)
        return TensorMeta(key, tuple(entry.size), entry.properties.dtype, chunks)

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
        payload = self._item_bytes(index)
        info = self.metadata.storage_data[index]
        try:
            return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
        except Exception as err:
            raise CheckpointError(f"{index.fqn} in {info.relative_path} is unreadable: {err}") from None

    def read_object(self, key: str) -> Any:
        """A non-tensor item (megatron ShardedObject payload)."""
        return self._load_item(MetadataIndex(key))

    def read(self, key: str, offsets: tuple[int, ...] | None = None, sizes: tuple[int, ...] | None = None):
        """The region [offsets, offsets + sizes) of a global tensor (the whole tensor by default)."""
        meta = self.tensor_meta(key)
        offsets = offsets or (0,) * len(meta.shape)
        sizes = sizes or meta.shape
        out = torch.empty(sizes, dtype=meta.dtype)
        covered = 0
        for chunk_offsets, chunk_sizes in meta.chunks:
            overlap = _overlap(offsets, sizes, chunk_offsets, chunk_sizes)
            if overlap is None:
                continue
            data = self._load_item(MetadataIndex(key, torch.Size(chunk_offsets)))
            src = tuple(slice(lo - c, hi - c) for (lo, hi), c in zip(overlap, chunk_offsets, strict=True))
            dst = tuple(slice(lo - o, hi - o) for (lo, hi), o in zip(overlap, offsets, strict=True))
            out[dst] = data[src]
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
