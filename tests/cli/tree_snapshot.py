"""Byte-for-byte snapshots of directory trees, for asserting that a refused or failed command changed nothing.

`snapshot(*roots)` records every path under each root (the root included) as what it is: a file's sha256 and
permission bits, a directory's permission bits, a symlink's target, or "absent". Comparing two snapshots of the
same roots shows any file written, changed, removed or left behind (a staging sibling, a half-written
destination), so snapshot a destination's parent rather than the destination alone.

Usage, shared by every bad-input test:

    before = snapshot(source, tmp_path)
    ... run the command ...
    assert_unchanged(before, source, tmp_path)
"""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

Snapshot = dict[str, str]


def _describe(path: Path) -> str:
    info = path.lstat()
    mode = oct(stat.S_IMODE(info.st_mode))
    if stat.S_ISLNK(info.st_mode):
        return f"link -> {path.readlink()}"
    if stat.S_ISDIR(info.st_mode):
        return f"dir {mode}"
    if stat.S_ISREG(info.st_mode):
        digest = hashlib.sha256()
        with path.open("rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
        return f"file {mode} sha256={digest.hexdigest()}"
    return f"special {stat.S_IFMT(info.st_mode):o}"


def snapshot(*roots: Path) -> Snapshot:
    """Every path under each root (symlinks not followed) mapped to its type, mode and content hash."""
    entries: Snapshot = {}
    for root in roots:
        root = Path(root)
        if not root.exists() and not root.is_symlink():
            entries[str(root)] = "absent"
            continue
        entries[str(root)] = _describe(root)
        if root.is_dir() and not root.is_symlink():
            for path in sorted(root.rglob("*")):
                entries[str(path)] = _describe(path)
    return entries


def assert_unchanged(before: Snapshot, *roots: Path) -> None:
    """Fail with the paths that were added, removed or changed since `before` was taken of the same roots."""
    after = snapshot(*roots)
    added = sorted(after.keys() - before.keys())
    removed = sorted(before.keys() - after.keys())
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    assert not (added or removed or changed), f"added {added[:5]}, removed {removed[:5]}, changed {changed[:5]}"
