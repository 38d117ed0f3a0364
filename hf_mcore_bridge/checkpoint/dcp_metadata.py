"""A DCP checkpoint's `.metadata`, written and read without importing torch.distributed.checkpoint.

The file is a pickle of torch's `Metadata` dataclass: per key, a `TensorStorageMetadata` (dtype, global shape, the
chunks' offsets and sizes) or a `BytesStorageMetadata`, and per stored item where its bytes are (`_StorageInfo`:
file, offset, length). Importing the package that defines those classes costs most of a second (it pulls in
DTensor and sympy), more than writing a small model's checkpoint. `metadata_pickle` writes the pickle that DCP's
`FileSystemWriter` writes for the same items, naming the classes without importing them (`pickles`), and
`MetadataUnpickler` reads any DCP `.metadata` into stand-ins with the same attribute names, resolving nothing but
an allow-list of names (a `.metadata` is untrusted input). `writer_contract` checks the pickle against DCP's own
writer at run time (as loaded: its bytes differ by design).
"""

from __future__ import annotations

import pickle
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from hf_mcore_bridge.checkpoint import dtypes
from hf_mcore_bridge.checkpoint.pickles import Call, Global, New, Pairs, dumps
from hf_mcore_bridge.errors import CheckpointError

_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
_PLANNER = "torch.distributed.checkpoint.planner"
VERSION = "1.0.0"
"""The metadata version DCP writes (torch 2.6 - 2.13)."""


@dataclass(frozen=True)
class StoredTensor:
    """One tensor key: its dtype name (`bfloat16`), global shape and chunks (offsets, sizes) in plan order."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]


@dataclass(frozen=True)
class StoredItem:
    """Where one item's bytes are: a tensor chunk (`offsets` given) or a bytes object (`offsets` None)."""

    key: str
    offsets: tuple[int, ...] | None
    relative_path: str
    offset: int
    length: int


def _size(values: Sequence[int]) -> Call:
    return Call(Global("torch", "Size"), (tuple(values),))


def _new(module: str, name: str, state: Any) -> New:
    return New(Global(module, name), state)


def _tensor_metadata(tensor: StoredTensor) -> New:
    layout = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Call(Global(_METADATA, "_MEM_FORMAT_ENCODING"), (0,))
    properties = _new(_METADATA, "TensorProperties", (Global("torch", tensor.dtype), layout, False, contiguous, False))
    chunks = [
        _new(_METADATA, "ChunkStorageMetadata", {"offsets": _size(offsets), "sizes": _size(sizes)})
        for offsets, sizes in tensor.chunks
    ]
    return _new(
        _METADATA, "TensorStorageMetadata", {"properties": properties, "size": _size(tensor.shape), "chunks": chunks}
    )


def metadata_pickle(
    order: Sequence[str],
    tensors: Sequence[StoredTensor],
    items: Sequence[StoredItem],
    checkpoint_id: Path,
    save_id: str = "",
) -> bytes:
    """The `.metadata` DCP's `FileSystemWriter` writes for these tensors and items (keys in `order`; a key that is
    not a tensor is a bytes object); `save_id` a random UUID when empty, as DCP's."""
    by_key = {t.key: t for t in tensors}
    chunk_index = {(t.key, offsets): i for t in tensors for i, (offsets, _) in enumerate(t.chunks)}
    state_dict = {
        key: _tensor_metadata(by_key[key]) if key in by_key else _new(_METADATA, "BytesStorageMetadata", {})
        for key in order
    }
    storage = []
    for item in items:
        if item.offsets is None:
            index_state: dict[str, Any] = {"fqn": item.key, "index": None}
        else:
            index = chunk_index[(item.key, item.offsets)]
            index_state = {"fqn": item.key, "index": index, "offset": _size(item.offsets)}
        info = {"relative_path": item.relative_path, "offset": item.offset, "length": item.length}
        storage.append((_new(_METADATA, "MetadataIndex", index_state), _new(_FILESYSTEM, "_StorageInfo", info)))
    parts = Path(checkpoint_id).absolute().parts
    meta = {"checkpoint_id": Call(Global("pathlib", "PosixPath"), parts), "save_id": save_id or str(uuid.uuid4())}
    storage_meta = _new(_METADATA, "StorageMeta", {**meta, "load_id": None, "modules": []})
    state = {
        "state_dict_metadata": state_dict,
        "planner_data": None,
        "storage_data": Pairs(tuple(storage)),
        "storage_meta": storage_meta,
        "version": VERSION,
    }
    return dumps(_new(_METADATA, "Metadata", state))


class Record:
    """A stand-in for one of DCP's metadata dataclasses: its pickled state becomes its attributes."""

    _fields: tuple[str, ...] = ()
    """Attribute names of a state pickled as a tuple (`TensorProperties.__getstate__`)."""

    def __init__(self, *args: Any) -> None:  # built by a call only as an enum member: `_MEM_FORMAT_ENCODING(0)`
        self.value = args[0] if args else None

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, tuple):
            state = dict(zip(self._fields, state, strict=False))
        if not isinstance(state, dict):
            raise pickle.UnpicklingError(f"unexpected state for {type(self).__name__}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class Metadata(Record):
    state_dict_metadata: dict[str, Any]
    planner_data: Any = None
    storage_data: Any = None
    storage_meta: Any = None
    version: str | None = None


class TensorStorageMetadata(Record):
    properties: Any
    size: tuple[int, ...]
    chunks: list[Any]


class BytesStorageMetadata(Record):
    pass


class ChunkStorageMetadata(Record):
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class TensorProperties(Record):
    _fields = ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")
    dtype: Any = None


class StorageInfo(Record):
    relative_path: str
    offset: int
    length: int
    transform_descriptors: Any = None


class MetadataIndex(Record):
    """The key of `storage_data`: equal (and hashed) by key name and chunk offsets, as DCP's own."""

    fqn: str
    offset: tuple[int, ...] | None = None
    index: int | None = None

    def __init__(self, fqn: str, offset: Sequence[int] | None = None, index: int | None = None):
        self.fqn, self.index = fqn, index
        if offset is not None:
            self.offset = tuple(offset)

    def _key(self) -> tuple[str, tuple[int, ...] | None]:
        return self.fqn, None if self.offset is None else tuple(self.offset)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MetadataIndex) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


def _stand_in(name: str) -> type:
    return type(name, (Record,), {})


_CLASSES: dict[tuple[str, str], Any] = {
    (_METADATA, "Metadata"): Metadata,
    (_METADATA, "TensorStorageMetadata"): TensorStorageMetadata,
    (_METADATA, "BytesStorageMetadata"): BytesStorageMetadata,
    (_METADATA, "ChunkStorageMetadata"): ChunkStorageMetadata,
    (_METADATA, "TensorProperties"): TensorProperties,
    (_METADATA, "MetadataIndex"): MetadataIndex,
    (_METADATA, "StorageMeta"): _stand_in("StorageMeta"),
    (_METADATA, "_MEM_FORMAT_ENCODING"): _stand_in("_MEM_FORMAT_ENCODING"),
    (_FILESYSTEM, "_StorageInfo"): StorageInfo,
    (_FILESYSTEM, "_StoragePrefix"): _stand_in("_StoragePrefix"),
    # megatron-core's save strategy caches each rank's plan in the metadata (`all_local_plans`)
    **{(_PLANNER, name): _stand_in(name) for name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")},
    ("torch", "Size"): tuple,
    ("torch.serialization", "_get_layout"): str,
    ("pathlib", "PosixPath"): PurePosixPath,
    ("pathlib", "PurePosixPath"): PurePosixPath,
    ("collections", "OrderedDict"): dict,
}

DTYPE_NAMES = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "int64",
    "int32",
    "int16",
    "int8",
    "uint8",
    "bool",
)
"""The dtypes a `.metadata` may name (read as `dtypes.DType`s)."""


class MetadataUnpickler(pickle.Unpickler):
    """Reads a `.metadata` into the stand-ins above; any other class or function is refused."""

    def find_class(self, module: str, name: str) -> Any:
        found = _CLASSES.get((module, name))
        if found is not None:
            return found
        if module == "torch" and name in DTYPE_NAMES:
            return dtypes.BY_NAME[name]
        raise CheckpointError(f"refusing to unpickle {module}.{name} from a checkpoint's .metadata")
