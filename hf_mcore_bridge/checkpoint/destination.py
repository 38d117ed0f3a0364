"""Where a writing command may put its output: the one check they all make, the lock, the marker, the leftovers.

`check_destination` is called by every command that writes a directory (`convert --to mcore`, `convert --to hf`,
`export`, `demo`) before any work, and again under the lock when the output is created (`atomic.atomic_directory`):

- real paths (symlinks followed) of the destination and every source: a destination equal to, inside, or containing
  a source is refused, and so is one overlapping what a symlink inside a source leads to (an HF hub cache's
  snapshot links its files into `blobs/`: replacing `blobs/` would delete the source's weights);
- an existing destination that is a mount point is refused (the final rename cannot replace it), before any work;
- a destination that cannot be looked up (a symlink loop in its path, a name too long) is refused naming that, and
  so is a name that leaves no room for the hidden siblings the output is built in (`check_name_length`); a symlink
  inside a source that leads nowhere (a loop) cannot overlap anything and is passed over;
- an absent or empty destination is fine; a non-empty one is replaced only with `--overwrite` and only when this tool
  wrote it (its marker file, `MARKER_NAME`, is inside), unless `--overwrite-foreign` says to replace anything.

The lock is `fcntl.flock` on `.NAME.lock` beside the destination, held for the whole write; the kernel releases it
when its process dies, even by SIGKILL, so a lock that can be taken means no live run of this tool is writing there.
Under the lock, leftovers of interrupted runs (`.NAME.partial-XXXXXXXX` and `.NAME.old-XXXXXXXX` siblings, the names
this tool gives) are removed with a one-line notice, or, for an `.old` one whose destination is missing (a run killed
between the two renames of a replacement), renamed back into place.

Assumes POSIX (flock, rename within a directory is atomic). The lock is advisory: it keeps runs of this tool apart,
not other programs.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from hf_mcore_bridge import __version__
from hf_mcore_bridge.checkpoint.paths import PathError, lookup, name_max, resolved
from hf_mcore_bridge.errors import BridgeError

TOOL_NAME = "hf-mcore-bridge"
MARKER_NAME = ".hf-mcore-bridge.json"
"""Written inside every directory this tool produces; `--overwrite` replaces only directories that hold it."""
_SUFFIX = re.compile(r"[0-9a-f]{8}")


class DestinationError(BridgeError):
    """A destination that may not be written: it overlaps a source, holds data this tool did not write, or is busy."""


def notice(message: str) -> None:
    """One line on stderr about something done to the user's files that they did not ask for by name."""
    print(f"note: {message}", file=sys.stderr, flush=True)


def real_path(path: Path | str, what: str = "path") -> Path:
    """Absolute path with every symlink followed (a missing tail is kept as given); `PathError` naming `what` for
    a symlink loop or a name too long."""
    return resolved(path, what)


SIBLING_SUFFIX = ".partial-00000000"
"""The longest suffix of the hidden siblings (`.NAME.partial-XXXXXXXX`, `.NAME.old-XXXXXXXX`, `.NAME.lock`)."""


def check_name_length(dst: Path, shown: Path | str | None = None) -> None:
    """Refuse a destination whose name fits the file system but whose hidden siblings' names would not."""
    limit = name_max(dst)
    longest = len(os.fsencode(f".{dst.name}{SIBLING_SUFFIX}"))
    if longest > limit:
        room = limit - (longest - len(os.fsencode(dst.name)))
        raise DestinationError(
            f"destination {shown or dst}: its name is {len(os.fsencode(dst.name))} bytes long, but the output is"
            f" built in a hidden sibling named .NAME{SIBLING_SUFFIX[:-8]}XXXXXXXX, which the file system takes only"
            f" for names of at most {room} bytes"
        )


LINK_DEPTH = 4
"""How deep below a source its symlinks are looked for: the files this tool reads lie at most this deep (a run's
`checkpoints/iter_XXXXXXX/model_optim/` file), and a source given too broadly (a home directory) stays quick."""


def linked_targets(source: Path, depth: int = LINK_DEPTH) -> Iterator[tuple[Path, Path]]:
    """(link, real target) of every symlink up to `depth` levels inside the directory `source` (not descending
    into linked directories): what the source reads lives there too, e.g. an HF hub cache's snapshot, whose files
    are links into the repository's `blobs/`."""
    for root, dirs, files in os.walk(source):
        for name in (*dirs, *files):
            link = Path(root, name)
            if link.is_symlink():
                try:
                    target = resolved(link, "source")
                except PathError:  # a loop leads nowhere: nothing there to overlap
                    continue
                yield link, target
        if len(Path(root).relative_to(source).parts) + 1 >= depth:
            dirs.clear()  # the entries of this level were looked at; nothing deeper


def _overlap(dst: Path, src: Path) -> str | None:
    if dst == src:
        return "is"
    if dst.is_relative_to(src):
        return "is inside"
    if src.is_relative_to(dst):
        return "contains"
    return None


def check_overlap(destination: Path | str, sources: Iterable[Path | str | None]) -> Path:
    """Refuse a destination equal to, inside, or containing any source, or anything a symlink inside a source
    leads to; return the destination's real path."""
    dst = real_path(destination, "destination")
    check_name_length(dst, destination)
    for source in sources:
        if source is None:
            continue
        src = real_path(source, "source")
        if problem := _overlap(dst, src):
            raise DestinationError(
                f"destination {destination} {problem} the source {source}; choose a directory apart from it"
            )
        if not src.is_dir():
            continue
        for link, target in linked_targets(src):
            if problem := _overlap(dst, target):
                raise DestinationError(
                    f"destination {destination} {problem} {target}, which the source links to ({link}); choose a"
                    " directory apart from it"
                )
    return dst


def read_marker(directory: Path) -> dict[str, Any] | None:
    """The marker this tool left in `directory`, or None when it holds none (or not a readable one of ours)."""
    try:
        record = json.loads((directory / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("written_by") == TOOL_NAME else None


def write_marker(directory: Path, record: dict[str, Any] | None = None) -> None:
    """Mark `directory` as written by this tool (version, time, pid and what the caller records, e.g. sources)."""
    marker = {"written_by": TOOL_NAME, "version": __version__, "created": time.time(), "pid": os.getpid()}
    (directory / MARKER_NAME).write_text(json.dumps({**marker, **(record or {})}, indent=2) + "\n")


def check_existing(dst: Path, shown: Path | str, *, overwrite: bool, overwrite_foreign: bool) -> None:
    """Refuse an existing destination that may not be replaced (`dst` is the real path, `shown` the user's)."""
    if lookup(dst, "destination") is None:
        return
    if not dst.is_dir():
        raise DestinationError(f"destination {shown} exists and is not a directory")
    if os.path.ismount(dst):
        raise DestinationError(
            f"destination {shown} is a mount point: the output is built beside it and renamed into place, which a"
            f" mount point cannot take; write into a directory inside it (e.g. {Path(shown) / 'model'})"
        )
    if not any(dst.iterdir()) or overwrite_foreign:
        return
    if read_marker(dst) is None:
        raise DestinationError(
            f"destination {shown} is not empty and was not written by {TOOL_NAME}; choose another directory "
            "(or pass --overwrite-foreign to delete what is in it)"
        )
    if not overwrite:
        raise DestinationError(f"destination {shown} is not empty; pass --overwrite to replace it")


def check_destination(
    destination: Path | str,
    sources: Iterable[Path | str | None] = (),
    *,
    overwrite: bool = False,
    overwrite_foreign: bool = False,
) -> Path:
    """The check every writing command makes before any work; returns the destination's real path.

    Raises `DestinationError` (one line) for a destination that overlaps a source or may not be replaced.
    """
    dst = check_overlap(destination, sources)
    check_existing(dst, destination, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
    return dst


def lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.lock"


@contextmanager
def destination_lock(dst: Path, shown: Path | str) -> Iterator[None]:
    """Hold the lock of destination `dst` (a real path whose parent exists); refuse when another run holds it.

    Not `filelock`: the refusal names the holder, so the holder writes its pid into the file it locks.
    """
    path = lock_path(dst)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise DestinationError(
                f"destination {shown} is being written by another run (pid {holder}); wait for it to finish"
            ) from None
        # The previous holder removes the file before releasing it: a lock taken on a removed file is no lock.
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        with suppress(FileNotFoundError):
            path.unlink()
        os.close(fd)


def _leftovers(dst: Path, kind: str) -> list[Path]:
    prefix = f".{dst.name}.{kind}-"
    return sorted(
        p
        for p in dst.parent.iterdir()
        if p.name.startswith(prefix) and _SUFFIX.fullmatch(p.name[len(prefix) :]) and p.is_dir() and not p.is_symlink()
    )


def clear_leftovers(dst: Path) -> None:
    """Tidy what interrupted runs to `dst` left beside it. Call only while holding `destination_lock(dst)`."""
    for old in _leftovers(dst, "old"):
        if not dst.exists():
            old.rename(dst)
            notice(f"restored {dst} from {old.name}, left by a run interrupted while replacing it")
        else:
            shutil.rmtree(old)
            notice(f"removed {old}, the replaced output of an interrupted run")
    for partial in _leftovers(dst, "partial"):
        if read_marker(partial) is not None or not any(partial.iterdir()):
            shutil.rmtree(partial)
            notice(f"removed {partial}, the unfinished output of an interrupted run")
        else:
            notice(f"left {partial} in place: named like an unfinished output, but without the {MARKER_NAME} marker")
