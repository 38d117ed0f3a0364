"""Atomic output directories: work goes into a temporary sibling that is renamed into place when complete.

An interrupted or failed run leaves no destination that looks complete (at most a hidden `.NAME.partial-*`
sibling, removed on failure), and an existing destination is only replaced once the new one is whole.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hf_mcore_bridge.errors import BridgeError


def check_destination(destination: Path, overwrite: bool) -> None:
    """Refuse a non-empty destination unless overwriting was asked for."""
    if destination.exists():
        if not destination.is_dir():
            raise BridgeError(f"destination {destination} exists and is not a directory")
        if any(destination.iterdir()) and not overwrite:
            raise BridgeError(f"destination {destination} is not empty; pass --overwrite to replace it")


@contextmanager
def atomic_directory(destination: Path, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `destination`; on success it replaces `destination`, on failure it is removed."""
    destination = destination.absolute()
    check_destination(destination, overwrite)
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.parent / f".{destination.name}.partial-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    old = None
    if destination.exists():
        old = destination.parent / f".{destination.name}.old-{uuid.uuid4().hex[:8]}"
        destination.rename(old)
    staging.rename(destination)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
