"""Writing a DCP checkpoint and `torch.save` archives through torch's own writers, not this project's framing.

The conversion writes torch's bytes itself where that buys speed (`torch_archive`, `dcp_metadata`, `dcp_writer`);
this module is what it writes with instead when the run-time contract (`writer_contract`) finds the installed
torch writing those bytes differently, or when told to (`HF_MCORE_BRIDGE_TORCH_WRITER=1`):

- every DCP item is the output of `torch.save` (a bytes item: of its payload, as DCP's planner saves it), written
  in plan order, bytes items first as DCP writes them, into one data file, one tensor in memory at a time;
- `.metadata` is DCP's own: `create_default_global_save_plan` builds the `Metadata` from the items' `WriteItem`s
  and `FileSystemWriter.finish` writes it from the items' places (`_StorageInfo`, which DCP's writer and
  megatron-core's build the same way).

Not `dcp.save` with a planner that hands it the chunks: `FileSystemWriter.write_data` keeps every tensor it has
written in a dict until its data file is closed (torch 2.13, for its safetensors format), so memory would hold
the whole model. Records are written without their CRC-32, as the rest of this project writes them (a fifth of
the writing time; no reader checks it).
"""

from __future__ import annotations

import argparse
import io
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hf_mcore_bridge.checkpoint.dtypes import DType

if TYPE_CHECKING:
    import torch

    from hf_mcore_bridge.checkpoint.dcp_writer import ObjectItem, TensorChunk

DATA_FILE = "__0_0.distcp"


@contextmanager
def without_crc32() -> Iterator[None]:
    """Skip the per-record CRC32 of `torch.save` (a fifth of the writing time); readers do not check it."""
    import torch

    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def torch_dtypes(value: Any) -> Any:
    """`value` with every `dtypes.DType` in its containers and namespaces replaced by torch's dtype."""
    if isinstance(value, DType):
        return value.torch
    if isinstance(value, argparse.Namespace):
        return argparse.Namespace(**{k: torch_dtypes(v) for k, v in vars(value).items()})
    if type(value) in (list, tuple):
        return type(value)(torch_dtypes(v) for v in value)
    if type(value) is dict:
        return {k: torch_dtypes(v) for k, v in value.items()}
    return value


def saved_by_torch(payload: object) -> bytes:
    """The bytes of `torch.save(payload)` (a `dtypes.DType` in it saved as torch's dtype), without CRC-32."""
    import torch

    buffer = io.BytesIO()
    with without_crc32():
        torch.save(torch_dtypes(payload), buffer)
    return buffer.getvalue()


def produced(chunk: TensorChunk) -> torch.Tensor:
    """The chunk's tensor, contiguous; an AssertionError when it is not of the planned shape and dtype."""
    tensor = chunk.produce()
    if tuple(tensor.shape) != chunk.sizes or str(tensor.dtype).removeprefix("torch.") != chunk.dtype_name:
        raise AssertionError(
            f"{chunk.key} at {chunk.offsets}: produced {tuple(tensor.shape)} {tensor.dtype}, "
            f"planned {chunk.sizes} {chunk.dtype}"
        )
    return tensor.detach().contiguous()


def save_chunk(chunk: TensorChunk, handle: Any) -> None:
    """`torch.save` the chunk's tensor into an open file, owning its storage (else the whole storage is saved)."""
    import torch

    tensor = produced(chunk)
    if tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    with without_crc32():
        torch.save(tensor, handle)


def write_dcp_with_torch(
    directory: Path,
    chunks: Sequence[TensorChunk],
    objects: Sequence[ObjectItem],
    on_write: Callable[[], None] = lambda: None,
) -> None:
    """Write a DCP checkpoint of `chunks` and `objects` into `directory` (created if missing): each item by
    `torch.save`, the `.metadata` by DCP's `FileSystemWriter`. `on_write` is called once per item written."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.planner import SavePlan
    from torch.distributed.checkpoint.storage import WriteResult

    directory.mkdir(parents=True, exist_ok=True)
    items = [_object_item(obj.key) for obj in objects] + [_tensor_item(chunk) for chunk in chunks]
    (plan,), metadata = create_default_global_save_plan([SavePlan(items)])  # index hints as DCP sets them
    places: list[tuple[int, int]] = []
    with (directory / DATA_FILE).open("wb") as handle:
        for data in _item_bytes(chunks, objects):
            start = handle.tell()
            data(handle)
            places.append((start, handle.tell() - start))
            on_write()
    results = [
        WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(DATA_FILE, offset, length))
        for item, (offset, length) in zip(plan.items, places, strict=True)
    ]
    FileSystemWriter(str(directory), single_file_per_rank=True, sync_files=False).finish(metadata, [results])


def _item_bytes(chunks: Sequence[TensorChunk], objects: Sequence[ObjectItem]) -> Iterator[Callable[[Any], None]]:
    """Per item in plan order, a function that writes it to an open file; tensors produced one at a time."""
    for obj in objects:
        yield lambda handle, payload=obj.payload: handle.write(saved_by_torch(payload))
    for chunk in chunks:
        yield lambda handle, chunk=chunk: save_chunk(chunk, handle)


def _object_item(key: str) -> Any:
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

    return WriteItem(index=MetadataIndex(key), type=WriteItemType.BYTE_IO)


def _tensor_item(chunk: TensorChunk) -> Any:
    """The `WriteItem` DCP's planner makes for a chunk: a whole tensor (offsets zero, sizes its shape) or a shard."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    offsets, sizes = torch.Size(chunk.offsets), torch.Size(chunk.sizes)
    whole = chunk.sizes == chunk.global_shape
    dtype = chunk.dtype.torch if isinstance(chunk.dtype, DType) else chunk.dtype
    return WriteItem(
        index=MetadataIndex(chunk.key, offsets),
        type=WriteItemType.TENSOR if whole else WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
            properties=TensorProperties(dtype=dtype),
            size=torch.Size(chunk.global_shape),
        ),
    )
