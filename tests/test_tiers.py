"""The two test tiers (tests/conftest.py): every test id the tier lists exists, and the fast tier reaches every
package of the project and starts a world for every parallel dimension."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _tiers() -> object:
    """tests/conftest.py by its path (the name `conftest` is shared by every folder's conftest)."""
    spec = importlib.util.spec_from_file_location("tests_root_conftest", ROOT / "tests" / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _collected(marker: str) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only", "-m", marker, "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return {line.strip() for line in done.stdout.splitlines() if "::" in line}


def test_every_listed_test_exists_and_the_fast_tier_reaches_every_package() -> None:
    conftest: Any = _tiers()
    everything = _collected("fast or not fast")
    fast = _collected("fast")
    listed = conftest.EXTENDED | conftest.FAST_WORLDS | conftest.FULL_ONLY
    assert not listed - everything, f"listed but not collected (renamed?): {sorted(listed - everything)}"
    assert fast >= conftest.FAST_WORLDS and not conftest.FULL_ONLY & fast
    # every test folder (one per package of the project) has tests in the fast tier
    folders = {Path(nodeid.split("::")[0]).parent for nodeid in everything}
    assert not {f for f in folders if not any(Path(n.split("::")[0]).parent == f for n in fast)}
    # and its worlds cover every parallel dimension
    layouts = (
        " ".join(re.findall(r"\[([^\]]+)\]", " ".join(conftest.FAST_WORLDS))) + " " + " ".join(conftest.FAST_WORLDS)
    )
    for dimension in ("tp2", "pp2", "cp2", "ep2", "dp2"):
        assert dimension in layouts, dimension
