"""Filling byte ranges of output files from byte ranges of input files, in the kernel where the bytes are unchanged.

A conversion that only regroups a tensor's rows (fusing QKV, chunking for tensor parallelism, stacking layers)
writes bytes that already exist in its input files. An output range is described as a sequence of pieces:

- `Span`: a contiguous range of an input file, copied with `os.copy_file_range` (the data never enters user
  space; on filesystems without it, through a mapping of the input);
- `Rows`: `count` rows, each the concatenation of one range per part at a fixed stride (a column slice of a
  row-major matrix, or rows interleaved from several chunks), written with `os.pwritev` from a read-only mapping
  of the input, so each byte is copied once, by the kernel;
- `Zeros` (vocabulary padding), `bytes` (framing such as a zip header) and `Produced` (bytes computed on demand,
  e.g. a tensor cast to another dtype).

`write_pieces` writes pieces at an offset of an open file, checking a stop event between system calls, each of
which moves at most `STEP` bytes, so a stop takes effect within milliseconds. Input files are assumed not to
change while they are read: each is checked for its size before it is mapped.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import mmap
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hf_mcore_bridge.errors import CheckpointError

STEP = 32 << 20
"""The most bytes one system call copies, so that a stop request waits at most that long."""
_IOV_MAX = 1024
_LONG_ROW = 1 << 20
"""Row parts at least this long are copied in the kernel one by one rather than gathered from a mapping."""
_ZEROS = bytes(1 << 20)
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EBADF}
"""Errors with which `copy_file_range` says it cannot copy between these files (the fallback then maps them)."""


@dataclass(frozen=True)
class Span:
    """Bytes [offset, offset + length) of an input file."""

    path: Path
    offset: int
    length: int


@dataclass(frozen=True)
class RowPart:
    """One range per row: row i is bytes [offset + i * stride, offset + i * stride + length) of `path`."""

    path: Path
    offset: int
    length: int
    stride: int


@dataclass(frozen=True)
class Rows:
    """`count` rows, each the concatenation of one range of every part."""

    count: int
    parts: tuple[RowPart, ...]

    @property
    def length(self) -> int:
        return self.count * sum(part.length for part in self.parts)


@dataclass(frozen=True)
class Zeros:
    """`length` zero bytes."""

    length: int


@dataclass(frozen=True)
class Produced:
    """`length` bytes computed when written: `produce` returns an object with the buffer protocol."""

    length: int
    produce: Callable[[], Any]


Piece = Span | Rows | Zeros | Produced | bytes


def length_of(piece: Piece) -> int:
    """The bytes a piece writes."""
    return len(piece) if isinstance(piece, bytes) else piece.length


class Stopped(Exception):
    """Raised inside a writer when its stop event is set (another writer failed, or the run was interrupted)."""


class InputFiles:
    """Read-only descriptors of input files, opened on first use; one per file for the writer using it."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._sizes: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self._fds.get(path)
        if fd is None:
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            except OSError as err:
                raise CheckpointError(f"reading {path} failed: {err.strerror or err}") from None
            self._fds[path] = fd
            self._sizes[path] = os.fstat(fd).st_size
        return fd

    def check_extent(self, path: Path, end: int) -> None:
        """Refuse to read past the end of an input (a mapping there would kill the process with SIGBUS)."""
        self.fd(path)
        if end > self._sizes[path] or end > os.fstat(self._fds[path]).st_size:
            raise CheckpointError(f"{path} is truncated: it ends before byte {end}, which the conversion reads")

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class _Output:
    """Positional writes into one open output file, with the file named in every error."""

    def __init__(self, fd: int, path: Path, offset: int, stop: threading.Event):
        self.fd, self.path, self.offset, self.stop = fd, path, offset, stop
        self.kernel_copy = True

    def check(self) -> None:
        if self.stop.is_set():
            raise Stopped

    def failed(self, err: OSError) -> OSError:
        return OSError(err.errno, err.strerror, str(self.path))

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        done = 0
        while done < len(view):
            self.check()
            try:
                done += os.pwrite(self.fd, view[done : done + STEP], self.offset + done)
            except OSError as err:
                raise self.failed(err) from None
        self.offset += len(view)

    def zeros(self, length: int) -> None:
        while length:
            step = min(length, len(_ZEROS))
            self.write(memoryview(_ZEROS)[:step])
            length -= step

    def copy(self, inputs: InputFiles, span: Span) -> None:
        inputs.check_extent(span.path, span.offset + span.length)
        src, done = inputs.fd(span.path), 0
        while done < span.length and self.kernel_copy:
            self.check()
            try:
                moved = os.copy_file_range(
                    src, self.fd, min(STEP, span.length - done), span.offset + done, self.offset + done
                )
            except OSError as err:
                if err.errno not in _NO_KERNEL_COPY:
                    raise self.failed(err) from None
                self.kernel_copy = False  # not between these filesystems: map the input from now on
                break
            if moved == 0:
                raise CheckpointError(f"{span.path} is truncated: it ends before byte {span.offset + span.length}")
            done += moved
        self.offset += done
        while done < span.length:  # no kernel copy: through a mapping, a step at a time
            step = min(STEP, span.length - done)
            self.rows(inputs, Rows(1, (RowPart(span.path, span.offset + done, step, step),)))
            done += step

    def rows(self, inputs: InputFiles, rows: Rows) -> None:
        if rows.length == 0:
            return
        if all(part.length >= _LONG_ROW for part in rows.parts) and self.kernel_copy:
            for i in range(rows.count):
                for part in rows.parts:
                    self.copy(inputs, Span(part.path, part.offset + i * part.stride, part.length))
            return
        row_bytes = sum(part.length for part in rows.parts)
        per_call = max(1, min(_IOV_MAX // len(rows.parts), STEP // max(row_bytes, 1)))  # rows per system call
        with _Mapped(inputs, rows) as views:
            for first in range(0, rows.count, per_call):
                last = min(first + per_call, rows.count)
                columns = [  # for each part, its ranges in these rows
                    [view[i * part.stride : i * part.stride + part.length] for i in range(first, last)]
                    for view, part in zip(views, rows.parts, strict=True)
                ]
                interleaved = itertools.chain.from_iterable(zip(*columns, strict=True))
                batch = columns[0] if len(columns) == 1 else list(interleaved)
                self._gather(batch, (last - first) * row_bytes)
                del batch, columns

    def _gather(self, buffers: list[memoryview], remaining: int) -> None:
        while remaining:
            self.check()
            try:
                written = os.pwritev(self.fd, buffers, self.offset)
            except OSError as err:
                raise self.failed(err) from None
            self.offset += written
            remaining -= written
            if remaining:  # a short write: go on after the last byte written
                first = 0
                while written >= len(buffers[first]):
                    written -= len(buffers[first])
                    first += 1
                buffers = [buffers[first][written:], *buffers[first + 1 :]]


class _Mapped:
    """Read-only mappings of the input regions that row parts read, released on exit (they count in the RSS).

    Each view starts at its part's first byte, so row i of a part is at `i * part.stride` in its view.
    """

    def __init__(self, inputs: InputFiles, rows: Rows):
        self._inputs, self._rows = inputs, rows
        self._maps: list[mmap.mmap] = []
        self._views: list[memoryview] = []

    def __enter__(self) -> list[memoryview]:
        for part in self._rows.parts:
            last = part.offset + (self._rows.count - 1) * part.stride + part.length
            self._inputs.check_extent(part.path, last)
            start = part.offset - part.offset % mmap.ALLOCATIONGRANULARITY
            mapped = mmap.mmap(self._inputs.fd(part.path), last - start, prot=mmap.PROT_READ, offset=start)
            self._maps.append(mapped)
            self._views.append(memoryview(mapped)[part.offset - start :])
        return self._views

    def __exit__(self, *exc: object) -> None:
        for view in self._views:
            view.release()
        for mapped in self._maps:
            with contextlib.suppress(BufferError):  # a view is still referenced (by a traceback): it goes with it
                mapped.close()


def write_pieces(
    fd: int, path: Path, offset: int, pieces: Sequence[Piece], inputs: InputFiles, stop: threading.Event
) -> int:
    """Write `pieces` one after another into the open file `fd` (named `path` in errors) from `offset` on; returns
    the offset after them. Raises `Stopped` when `stop` is set before the pieces are written."""
    out = _Output(fd, path, offset, stop)
    for piece in pieces:
        if isinstance(piece, bytes):
            out.write(piece)
        elif isinstance(piece, Span):
            out.copy(inputs, piece)
        elif isinstance(piece, Rows):
            out.rows(inputs, piece)
        elif isinstance(piece, Zeros):
            out.zeros(piece.length)
        else:
            data = memoryview(piece.produce()).cast("B")
            if len(data) != piece.length:
                raise AssertionError(f"produced {len(data)} bytes for {path}, planned {piece.length}")
            out.write(data)
    return out.offset
