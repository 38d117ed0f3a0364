"""Streaming writer of torch.distributed.checkpoint (DCP) directories, the storage under megatron-core's `torch_dist`.

A DCP directory is data files (`__0_0.distcp`, `__0_1.distcp`, ...) holding one item after another, plus a pickled
`.metadata` naming, per key, the global shape and chunks and, per item, its file, offset and length. A tensor
item is the archive `torch.save` writes for the chunk; a bytes item (megatron's ShardedObject) is the `torch.save`
of its payload. This writer lays out the same files as DCP's `FileSystemWriter` (checked against it and against
megatron-core's loader in the tests) without running DCP, whose import alone costs 1.3-1.8 s after torch's:

- every item's size is known before anything is written (the archive around a tensor is `torch_archive`'s), so
  the items are split into one queue per data file and the files are written in parallel (`parallel_write`);
- a chunk whose bytes exist unchanged in an input file is given as byte pieces (`byte_copy`) and copied in the
  kernel, framed by the archive's head and tail; any other chunk is produced as a tensor when its turn comes,
  so memory holds at most one tensor per writer thread;
- a chunk the archive cannot frame (4 GiB or more, or an unusual dtype) is appended afterwards with `torch.save`.

Items are written in plan order within each file, bytes items first, as DCP writes them. The bytes framed here
(each archive's head and tail, bytes items of plain values, the `.metadata`) are compared with the installed
torch's own writers before a conversion writes (`writer_contract`); where they differ, the conversion passes
`by_torch` and the checkpoint is written by `torch_writer` instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint.byte_copy import Piece, Produced, length_of
from hf_mcore_bridge.checkpoint.dcp_metadata import StoredItem, StoredTensor, metadata_pickle
from hf_mcore_bridge.checkpoint.parallel_write import Job, run_jobs
from hf_mcore_bridge.checkpoint.torch_archive import TensorArchive, saved_plain, supported
from hf_mcore_bridge.checkpoint.torch_writer import produced, save_chunk, saved_by_torch, write_dcp_with_torch

DATA_FILES = 2
"""Data files (and writer threads) of a checkpoint: two cores on the smallest machines we run on."""


@dataclass(frozen=True)
class TensorChunk:
    """One chunk of a global tensor, produced on demand."""

    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: Any
    """A `dtypes.DType` or a `torch.dtype`."""
    produce: Callable[[], Any]
    """Returns the chunk's data: a CPU tensor of shape `sizes` and dtype `dtype`."""
    pieces: tuple[Piece, ...] | None = None
    """The chunk's bytes (row-major, little-endian) as pieces of input files, when they are stored unchanged there;
    then `produce` is not called."""

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def nbytes(self) -> int:
        count = self.dtype.itemsize
        for size in self.sizes:
            count *= size
        return count


@dataclass(frozen=True)
class ObjectItem:
    """A non-tensor entry (megatron's ShardedObject), stored as the bytes of a `torch.save`."""

    key: str
    payload: object


@dataclass
class _Placed:
    key: str
    offsets: tuple[int, ...] | None
    file: int
    offset: int
    length: int


def write_dcp(
    directory: Path,
    chunks: Sequence[TensorChunk],
    objects: Sequence[ObjectItem] = (),
    on_write: Callable[[], None] = lambda: None,
    files: int = DATA_FILES,
    *,
    by_torch: bool = False,
) -> None:
    """Write a DCP checkpoint of `chunks` and `objects` into `directory` (created if missing), in `files` data
    files written in parallel; `by_torch`: through torch's own writers instead (`torch_writer`, one file).

    `on_write` is called once per item written (for progress reporting).
    """
    if by_torch:
        write_dcp_with_torch(directory, chunks, objects, on_write)
        return
    directory.mkdir(parents=True, exist_ok=True)
    frameable = [supported(c.dtype_name, c.nbytes) and sys.byteorder == "little" for c in chunks]
    framed = [c for c, ok in zip(chunks, frameable, strict=True) if ok]
    late = [c for c, ok in zip(chunks, frameable, strict=True) if not ok]
    queues: list[list[Job]] = [[] for _ in range(max(1, files))]
    ends = [0] * len(queues)
    placed: list[_Placed] = []

    def add(file: int, key: str, offsets: tuple[int, ...] | None, pieces: tuple[Piece, ...]) -> None:
        length = sum(length_of(p) for p in pieces)
        queues[file].append(Job(directory / _file_name(file), ends[file], pieces))
        placed.append(_Placed(key, offsets, file, ends[file], length))
        ends[file] += length

    for obj in objects:
        add(0, obj.key, None, (saved(obj.payload),))
    total = sum(c.nbytes for c in framed)
    done = 0
    archives: dict[tuple[str, tuple[int, ...]], TensorArchive] = {}  # one serialization id each, as torch has per run
    for chunk in framed:  # contiguous runs of the plan per file, of about equal size
        file = min(done * len(queues) // total, len(queues) - 1) if total else 0
        archive = archives.setdefault((chunk.dtype_name, chunk.sizes), TensorArchive(chunk.dtype_name, chunk.sizes))
        data = chunk.pieces if chunk.pieces is not None else (Produced(chunk.nbytes, _tensor_bytes(chunk)),)
        add(file, chunk.key, chunk.offsets, (archive.head, *data, archive.tail))
        done += chunk.nbytes
    for index in range(len(queues)):
        (directory / _file_name(index)).touch()
    run_jobs(queues, on_done=on_write)
    if late:
        _append_saved(directory, late, placed, ends[0], on_write)
    _write_metadata(directory, chunks, objects, placed)


def _file_name(index: int) -> str:
    return f"__0_{index}.distcp"


def _tensor_bytes(chunk: TensorChunk) -> Callable[[], Any]:
    def produce() -> Any:
        import torch

        return produced(chunk).reshape(-1).view(torch.uint8).numpy()

    return produce


def saved(payload: object, *, by_torch: bool = False) -> bytes:
    """The bytes of `torch.save(payload)`: written without torch for a payload of plain values, namespaces and
    dtypes (`torch_archive.saved_plain`) in a process that has not imported torch, where that saves its import;
    else, or `by_torch`, by `torch.save` itself (a `dtypes.DType` in it saved as torch's dtype)."""
    if not by_torch and "torch" not in sys.modules:
        try:
            return saved_plain(payload)
        except TypeError:
            pass
    return saved_by_torch(payload)


def _append_saved(
    directory: Path, chunks: Sequence[TensorChunk], placed: list[_Placed], offset: int, on_write: Callable[[], None]
) -> None:
    """`torch.save` each chunk at the end of the first data file (for chunks the archive cannot frame)."""
    with (directory / _file_name(0)).open("r+b") as handle:
        handle.seek(offset)
        for chunk in chunks:
            start = handle.tell()
            save_chunk(chunk, handle)
            placed.append(_Placed(chunk.key, chunk.offsets, 0, start, handle.tell() - start))
            on_write()


def _write_metadata(
    directory: Path, chunks: Sequence[TensorChunk], objects: Sequence[ObjectItem], placed: list[_Placed]
) -> None:
    boxes: dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    first: dict[str, TensorChunk] = {}
    for chunk in chunks:
        first.setdefault(chunk.key, chunk)
        boxes.setdefault(chunk.key, []).append((chunk.offsets, chunk.sizes))
    tensors = [StoredTensor(k, c.dtype_name, c.global_shape, tuple(boxes[k])) for k, c in first.items()]
    order = [obj.key for obj in objects] + list(first)
    items = [StoredItem(p.key, p.offsets, _file_name(p.file), p.offset, p.length) for p in placed]
    (directory / ".metadata").write_bytes(metadata_pickle(order, tensors, items, directory))
