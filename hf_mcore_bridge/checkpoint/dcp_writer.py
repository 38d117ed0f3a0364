"""Streaming writer of torch.distributed.checkpoint (DCP) directories, the storage under megatron-core's `torch_dist`.

torch's own `FileSystemWriter` does the file format; a custom save planner supplies the plan (every chunk's key,
global shape, offsets and dtype, known up front from the model config) and produces each chunk's data lazily,
one at a time, when the writer asks for it, and freed once written. So a whole model is written from one process,
without a process group, holding at most the tensor being produced. With one writer thread the chunks are written
in plan order, which lets a producer reuse one fused tensor for its tensor-parallel chunks.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint import save as dcp_save
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, TensorWriteData, WriteItem, WriteItemType


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a global tensor, produced on demand."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]
    """Returns the chunk's data: a CPU tensor of shape `sizes` and dtype `dtype`."""


@dataclass(frozen=True)
class ObjectItem:
    """A non-tensor entry (megatron's ShardedObject), stored as the bytes of a `torch.save`."""

    key: str
    payload: object


class _StreamingPlanner(SavePlanner):
    """A save planner whose plan is given and whose data is produced lazily per write item."""

    def __init__(self, chunks: Sequence[TensorChunk], objects: Sequence[ObjectItem], on_write: Callable[[], None]):
        self._items: list[WriteItem] = []
        self._written: torch.Tensor | None = None
        """The last tensor handed to the writer."""
        self._producers: dict[tuple[str, tuple[int, ...]], Callable[[], torch.Tensor | io.BytesIO]] = {}
        self._on_write = on_write
        for obj in objects:
            self._items.append(WriteItem(index=MetadataIndex(obj.key), type=WriteItemType.BYTE_IO))
            self._producers[(obj.key, ())] = _bytes_of(obj.payload)
        for chunk in chunks:
            offsets = torch.Size(chunk.offsets)
            self._items.append(
                WriteItem(
                    index=MetadataIndex(chunk.key, offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=torch.Size(chunk.sizes)),
                        properties=TensorProperties(dtype=chunk.dtype),
                        size=torch.Size(chunk.global_shape),
                    ),
                )
            )
            self._producers[(chunk.key, tuple(chunk.offsets))] = _checked(chunk)

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator: bool = True) -> None:  # type: ignore[override]
        del state_dict, storage_meta, is_coordinator

    def create_local_plan(self) -> SavePlan:
        return SavePlan(self._items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        offsets = tuple(write_item.index.offset) if write_item.index.offset is not None else ()
        data = self._producers.pop((write_item.index.fqn, offsets))()
        if isinstance(data, torch.Tensor):
            # torch's writer keeps every tensor it wrote to a file, by key, until the file is closed (for its
            # safetensors format): one chunk per key, so memory would grow with the keys of a heterogeneous stack.
            # Its serial loader asks for the next tensor only after writing the last: that one's storage is freed.
            # (Tensors read straight from safetensors files are memory-mapped, not resizable, and cost page cache.)
            if self._written is not None and self._written.untyped_storage().resizable():
                self._written.untyped_storage().resize_(0)
            self._written = data
        self._on_write()
        return data


def _bytes_of(payload: object) -> Callable[[], io.BytesIO]:
    def produce() -> io.BytesIO:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        return buffer

    return produce


def _checked(chunk: TensorChunk) -> Callable[[], torch.Tensor]:
    def produce() -> torch.Tensor:
        tensor = chunk.produce()
        if tuple(tensor.shape) != chunk.sizes or tensor.dtype != chunk.dtype:
            raise AssertionError(
                f"{chunk.key} at {chunk.offsets}: produced {tuple(tensor.shape)} {tensor.dtype}, "
                f"planned {chunk.sizes} {chunk.dtype}"
            )
        return tensor.contiguous()

    return produce


@contextmanager
def _without_crc32() -> Iterator[None]:
    """Skip the per-record CRC32 of `torch.save` (a fifth of the writing time); readers do not check it."""
    previous = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(previous)


def write_dcp(
    directory: Path,
    chunks: Sequence[TensorChunk],
    objects: Sequence[ObjectItem] = (),
    on_write: Callable[[], None] = lambda: None,
) -> None:
    """Write a DCP checkpoint of `chunks` and `objects` into `directory` (created if missing).

    `on_write` is called once per item written (for progress reporting).
    """
    directory.mkdir(parents=True, exist_ok=True)
    planner = _StreamingPlanner(chunks, objects, on_write)
    # no copy-ahead: the serial loader (see `_StreamingPlanner.resolve_data`), as torch uses without CUDA anyway
    writer = FileSystemWriter(
        str(directory), single_file_per_rank=True, thread_count=1, sync_files=False, per_thread_copy_ahead=0
    )
    with warnings.catch_warnings(), _without_crc32():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        try:
            dcp_save({}, storage_writer=writer, planner=planner, no_dist=True)
        except CheckpointException as err:
            # DCP wraps whatever a producer raised (a read error, Ctrl-C); surface the original
            original = next(iter(err.failures.values()))[0]
            raise original from None
