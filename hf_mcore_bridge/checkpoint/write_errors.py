"""Failures while writing an output, reported as one line naming the file and the real cause.

Writers fail in ways that hide the cause: `torch.save` (used by DCP, the legacy format and `common.pt`) turns a
full disk into `unexpected pos 704 vs 598`, and a Python `write()` on a full disk raises an `OSError` without a
file name. Inside `reported_write_errors` an `OSError` becomes a `WriteError` naming the file (as it will be
named under the destination) and the mount it is on; a torch serialization failure is traced to its cause by
writing a probe file next to the failed one, which fails with the errno the serializer swallowed; safetensors'
serializer (`save_pretrained`) keeps the errno in its message (`(os error 28)`), which is read. A copy that fails
names its source first: an error only a write raises (full disk, quota, read-only) is a write error whatever file
it names first.
`written_atomically` is `atomic.atomic_directory` with both kinds of failure reported so: those while writing into
the temporary sibling, and those around it (creating it on a read-only mount, renaming it into place).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from hf_mcore_bridge.checkpoint.atomic import atomic_directory
from hf_mcore_bridge.errors import BridgeError, CheckpointError

_TORCH_WRITE_FAILURES = ("unexpected pos", "PytorchStreamWriter failed", "inline_container")
"""Substrings of the RuntimeError torch's zip writer raises when a write to its file fails."""

_RUST_IO_ERROR = re.compile(r"\(os error (\d+)\)")
"""How an I/O error of a Rust library (safetensors' serializer) ends its message: `... (os error 28)`."""

_PROBE_BYTES = 1 << 20


class WriteError(BridgeError):
    """Writing the output failed for a reason outside the tool: full disk, quota, read-only mount, I/O error."""


def device_of(path: Path) -> str:
    """The mount point a path lives on, with its source device when known (`/data (/dev/nvme0n1p1)`)."""
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    mount = path
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    source = _mount_source(mount)
    return f"{mount} ({source})" if source and source != str(mount) else str(mount)


def _mount_source(mount: Path) -> str | None:
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return None
    sources = [line.split()[0] for line in lines if len(line.split()) > 1 and line.split()[1] == str(mount)]
    return sources[-1] if sources else None  # the last mount on a point is the visible one


def describe(code: int | None, file: Path, device: str, fallback: str) -> str:
    """One line for a write that failed with `code` (an errno; None: unknown, `fallback` says what happened)."""
    if code == errno.ENOSPC:
        return f"no space left on {device} while writing {file}"
    if code == errno.EDQUOT:
        return f"disk quota exceeded on {device} while writing {file}"
    if code == errno.EROFS:
        return f"{device} is read-only; cannot write {file}"
    if code == errno.EIO:
        return f"I/O error on {device} while writing {file}"
    if code in (errno.EACCES, errno.EPERM):
        return f"permission denied writing {file}"
    if code == errno.EFBIG:
        return f"{file} is larger than {device} allows"
    if code is not None:
        return f"{os.strerror(code).lower()} while writing {file} (on {device})"
    return f"writing {file} failed: {fallback}"


def probe_errno(directory: Path) -> int | None:
    """The errno a fresh write of up to 1 MiB into `directory` fails with; None when it succeeds."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        with probe.open("wb") as handle:
            handle.write(b"\0" * _PROBE_BYTES)
            handle.flush()
            os.fsync(handle.fileno())
        return None
    except OSError as err:
        return err.errno
    finally:
        probe.unlink(missing_ok=True)


def _newest_file(directory: Path) -> Path:
    files = [p for p in directory.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else directory


def _shown(file: Path, staging: Path | None, destination: Path) -> Path:
    if staging is None:  # outside the temporary sibling: it, or an older destination moved aside, is the destination
        return destination if file.name.startswith(f".{destination.name}.") else file
    try:
        return destination / file.relative_to(staging)
    except ValueError:
        return file


@contextmanager
def written_atomically(destination: Path, **options: Any) -> Iterator[Path]:
    """`atomic_directory(destination, **options)` with every failure to write reported as one line naming file and
    cause."""
    with (
        reported_write_errors(None, destination),
        atomic_directory(destination, **options) as staging,
        reported_write_errors(staging, destination),
    ):
        yield staging


@contextmanager
def reported_write_errors(staging: Path | None, destination: Path) -> Iterator[None]:
    """Turn a failure while writing under `staging` into a one-line `WriteError` (exit 2 in the CLI).

    The file is named as it would be under `destination`; with no `staging`, failures around it (in the
    destination's parent) are reported. Errors of other kinds pass through unchanged.
    """
    try:
        yield
    except BridgeError:
        raise
    except Exception as err:
        rust = _RUST_IO_ERROR.search(str(err))  # safetensors' writer (save_pretrained) reports the OS error so
        torch = isinstance(err, RuntimeError) and any(marker in str(err) for marker in _TORCH_WRITE_FAILURES)
        if not (isinstance(err, OSError) or rust or torch):
            raise
        raise _reported(err, staging, destination, int(rust.group(1)) if rust else None) from err


_WRITE_ONLY_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)
"""Errors only a write raises: whatever file an `OSError` names first, the write failed."""


def _reported(err: Exception, staging: Path | None, destination: Path, code: int | None = None) -> BridgeError:
    output = staging if staging is not None else destination.absolute().parent
    if isinstance(err, OSError):
        # a copy (`shutil.copy2`) names its source first and its target second, whichever of the two failed
        named = [Path(name) for name in (err.filename, err.filename2) if name]
        inside = [file for file in named if file.absolute().is_relative_to(output.absolute())]
        if named and not inside and err.errno not in _WRITE_ONLY_ERRNOS:
            return CheckpointError(f"{(err.strerror or str(err)).lower()} while reading {named[0]}")
        file = inside[0] if inside else _newest_file(output)
        return WriteError(describe(err.errno, _shown(file, staging, destination), device_of(output), str(err)))
    file = _newest_file(output) if staging is not None else destination
    if code is None:
        code = probe_errno(file.parent if file.is_file() or staging is None else file)
    first_line = str(err).strip().splitlines()[0]
    return WriteError(describe(code, _shown(file, staging, destination), device_of(output), first_line))
