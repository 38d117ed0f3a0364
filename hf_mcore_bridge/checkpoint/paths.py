"""Looking paths up so that a path the file system cannot follow is named as such, in one line.

`os.stat` and `Path.resolve` fail in two ways a user can cause by what they type or link, and that say nothing
useful as they come: a symlink loop (ELOOP; `Path.resolve` raises `RuntimeError("Symlink loop ...")` on Python
< 3.13) and a name longer than the file system takes (ENAMETOOLONG: a component over `NAME_MAX` bytes, or a path
over `PATH_MAX`). `lookup` and `resolved` turn them into `PathError` naming the path, the option it came from and
which of the two it is; a path that is simply absent is `None` for `lookup`, so callers keep their own "no such
directory" message.

Assumes POSIX. Standard library only: the command line's up-front checks use it before anything heavy loads.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

from hf_mcore_bridge.errors import BridgeError

__all__ = ["PathError", "described", "lookup", "name_max", "resolved"]

_ABSENT = (errno.ENOENT, errno.ENOTDIR)


class PathError(BridgeError):
    """A path the file system cannot look up: a symlink loop, a name too long, no permission to search it.
    `reason` is the message's part after the path, for callers that phrase the line themselves."""

    def __init__(self, what: str, path: Path | str, reason: str) -> None:
        self.path, self.reason = Path(path), reason
        super().__init__(f"{what}: {path} {reason}")


def name_max(path: Path | str) -> int:
    """NAME_MAX of the file system the nearest existing ancestor of `path` lies on (255 where it cannot be read)."""
    for ancestor in Path(os.path.abspath(path)).parents:
        try:
            return os.pathconf(ancestor, "PC_NAME_MAX")
        except OSError:
            continue
    return 255


def described(path: Path | str, err: OSError, what: str) -> PathError:
    """The error for a failed look-up of `path` (`what` names where it came from: an option, "source", a file)."""
    path = Path(path)
    if err.errno == errno.ELOOP:
        return PathError(what, path, "cannot be followed: symlinks in it form a loop")
    if err.errno == errno.ENAMETOOLONG:
        limit = name_max(path)
        longest = max((len(os.fsencode(part)) for part in path.parts), default=0)
        if longest > limit:
            return PathError(what, path, f"holds a name of {longest} bytes; the file system takes at most {limit}")
        return PathError(what, path, f"is longer than the system takes ({len(os.fsencode(str(path)))} bytes)")
    return PathError(what, path, f"cannot be looked up: {err.strerror or err}")


def lookup(path: Path | str, what: str) -> os.stat_result | None:
    """`os.stat(path)` (symlinks followed); None when nothing is there. Raises `PathError` for a path that cannot
    be looked up (a loop, a name too long, a directory without search permission)."""
    try:
        return os.stat(path)
    except OSError as err:
        if err.errno in _ABSENT:
            return None
        raise described(path, err, what) from None


def resolved(path: Path | str, what: str) -> Path:
    """The absolute path with every symlink followed (a missing tail kept as given); `PathError` for a loop or a
    name too long anywhere in it."""
    path = Path(path).expanduser()
    try:
        real = path.resolve()
    except RuntimeError:  # Python < 3.13 reports a loop this way, without the errno
        raise described(path, OSError(errno.ELOOP, "loop"), what) from None
    except OSError as err:
        raise described(path, err, what) from None
    lookup(real, what)  # a loop or a name too long past the part that exists
    return real
