"""`scripts/setup.sh` as a GPU machine runs it: TORCH_SPEC empty keeps the system's torch (a venv that sees the
system's packages), WHEELS installs offline and names what is still missing, and the installed package maps the
top-level `mappings/` (what `PYTHONPATH=.` did not). The "system" packages are this venv's, handed to the new venv
through PYTHONPATH; a copy of the tracked files stands for a fresh checkout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from site_standin import system_site

pytestmark = pytest.mark.slow  # three venvs and two pip installs: I/O-bound, tens of seconds

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def checkout(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("checkout")
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    archive = subprocess.run(["tar", "cf", "-", "--null", "-T", "-"], cwd=ROOT, input=files, capture_output=True)
    subprocess.run(["tar", "xf", "-"], cwd=target, input=archive.stdout, check=True)
    (target / "wheels").mkdir()
    return target


BASE_PYTHON = str(Path(sys.base_prefix) / "bin" / "python3")
"""An interpreter that is no virtual environment: the "system" packages reach it through PYTHONPATH only."""


def _setup(checkout: Path, pythonpath: str, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp"), "PYTHONPATH": pythonpath}
    environ |= {"PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHON": BASE_PYTHON} | env
    return subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=checkout, env=environ, capture_output=True, text=True, timeout=300
    )


def test_setup_keeps_the_system_torch_and_installs_offline(checkout: Path, tmp_path: Path) -> None:
    # the project itself is not installed on the "system" (this venv's editable install would shadow the new one)
    system = system_site(tmp_path / "system", ("hf_mcore_bridge", "__editable__"))
    without_megatron = system_site(tmp_path / "partial", ("hf_mcore_bridge", "__editable__", "megatron"))
    # no torch anywhere: refused before anything is installed, the venv included
    bare = _setup(checkout, "", TORCH_SPEC="", EXTRAS="")
    assert bare.returncode == 2 and f"TORCH_SPEC is empty but {BASE_PYTHON} sees no torch" in bare.stderr
    assert not (checkout / ".venv").exists()
    # megatron-core neither on the system nor among the wheels: installed, then the missing module is named
    missing = _setup(checkout, str(without_megatron), TORCH_SPEC="", EXTRAS="", WHEELS="wheels")
    assert missing.returncode != 0 and "missing after the offline install: megatron.core" in missing.stderr
    # everything there: the venv sees the system's packages and the package imports its mappings
    done = _setup(checkout, str(system), TORCH_SPEC="", EXTRAS="", WHEELS="wheels")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "include-system-site-packages = true" in (checkout / ".venv" / "pyvenv.cfg").read_text()
    probe = subprocess.run(
        [str(checkout / ".venv/bin/python"), "-c", "import hf_mcore_bridge.mappings as m; print(m.__file__)"],
        cwd=tmp_path,
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(system)},
        capture_output=True,
        text=True,
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    assert probe.stdout.strip() == str(checkout / "mappings" / "__init__.py")
