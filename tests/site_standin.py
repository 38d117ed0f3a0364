"""A stand-in for the machine's site-packages, for the tests that run `scripts/setup.sh` against "system" packages
handed to the new venv through PYTHONPATH.

This interpreter's site directories are merged into one folder of symbolic links: a package, or a distribution's
metadata, from the first directory that has it, so that code and metadata stay of one version. The directory
holding torch comes first: where this venv only chains to another that holds the packages (a `.pth` line), that
other one is the installation, and its build tools (setuptools) are the ones that go with its packages."""

from __future__ import annotations

import site
import sys
from pathlib import Path


def _distribution(entry: Path) -> str | None:
    """The normalized project name of a `*.dist-info` / `*.egg-info` entry, else None."""
    if entry.suffix not in (".dist-info", ".egg-info"):
        return None
    return entry.name.split("-")[0].lower().replace("_", "-").replace(".", "-")


def system_site(directory: Path, leave_out: tuple[str, ...]) -> Path:
    """`directory`, made: this interpreter's packages, but those whose names start with one of `leave_out`."""
    directory.mkdir()
    seen: set[str] = set()
    roots = dict.fromkeys(p for p in [*site.getsitepackages(), *sys.path] if p.endswith("site-packages"))
    for root in sorted(roots, key=lambda root: not (Path(root) / "torch").is_dir()):
        entries = sorted(Path(root).iterdir()) if Path(root).is_dir() else []
        for entry in entries:
            if _distribution(entry) in seen or (directory / entry.name).exists() or entry.name.startswith(leave_out):
                continue
            (directory / entry.name).symlink_to(entry)
        seen |= {name for entry in entries if (name := _distribution(entry))}
    return directory
