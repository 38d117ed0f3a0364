"""Atomic output directories: work goes into a temporary sibling that is renamed into place when complete.

`atomic_directory` is how every writing command creates its output. Under the destination's lock
(`destination.destination_lock`) it tidies leftovers of interrupted runs, checks the destination again
(`destination.check_destination`: no overlap with a source, no replacing what this tool did not write), creates a
hidden `.NAME.partial-XXXXXXXX` sibling holding the tool's marker, and yields it. When the body finishes, the
sibling replaces the destination (the old one renamed aside, the new renamed in, the old removed); when it fails or
is interrupted (SIGINT, or SIGTERM, which raises `Terminated` while the body runs) the sibling is removed. A run
killed outright (SIGKILL, power loss) leaves the sibling; the next run to that destination removes it.

`sigterm_interrupts` gives a whole command the same behaviour: SIGTERM raises `Terminated` wherever the command is
(loading its libraries, reading its sources), so that it ends as after Ctrl-C, with its cleanup and exit status
143, rather than by the signal's default action.
"""

from __future__ import annotations

import shutil
import signal
import threading
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from hf_mcore_bridge.checkpoint.destination import (
    DestinationError,
    check_existing,
    check_overlap,
    clear_leftovers,
    destination_lock,
    write_marker,
)

_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while an output was being written; raised so that cleanup runs, like SIGINT's interrupt."""

    exit_code = 128 + signal.SIGTERM


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise Terminated


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """While the body runs (in the main thread), SIGTERM raises `Terminated` and SIGINT `KeyboardInterrupt`, also in
    a process started ignoring SIGINT (a background job of a script); the previous handlers are put back after.
    Elsewhere than in the main thread, where no handler can be set, a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


@contextmanager
def atomic_directory(
    destination: Path | str,
    *,
    sources: Iterable[Path | str | None] = (),
    overwrite: bool = False,
    overwrite_foreign: bool = False,
    record: dict[str, Any] | None = None,
) -> Iterator[Path]:
    """Yield a temporary sibling of `destination`; on success it replaces `destination`, on failure it is removed.

    `sources` are the paths the caller reads (the destination may not overlap them); `record` goes into the marker.
    """
    shown = destination
    dst = check_overlap(destination, sources)
    dst.parent.mkdir(parents=True, exist_ok=True)
    with destination_lock(dst, shown):
        clear_leftovers(dst)
        check_existing(dst, shown, overwrite=overwrite, overwrite_foreign=overwrite_foreign)
        staging = dst.parent / f".{dst.name}.partial-{uuid.uuid4().hex[:8]}"
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, _raise_terminated) if main_thread else None
        try:
            staging.mkdir()
            try:
                write_marker(staging, record)
                yield staging
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            # A stop signal now would land between the renames or while the replaced output is removed: hold it
            # until the swap is done. It is delivered after the old handler is back (the run then ends as usual).
            mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)
            try:
                _replace(staging, dst)
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)
                    previous = None
                signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _replace(staging: Path, dst: Path) -> None:
    """Put `staging` at `dst`; an existing `dst` is renamed aside and removed only once the new one is in place.

    When a rename fails (e.g. `dst` is a mount point) the old output is put back and the new one removed.
    """
    old = dst.parent / f".{dst.name}.old-{uuid.uuid4().hex[:8]}" if dst.exists() else None
    try:
        if old is not None:
            dst.rename(old)
        staging.rename(dst)
    except OSError as err:
        if old is not None and old.exists() and not dst.exists():
            old.rename(dst)
        shutil.rmtree(staging, ignore_errors=True)
        raise DestinationError(f"could not put the output in place at {dst}: {err.strerror or err}") from None
    if old is not None:
        shutil.rmtree(old)
