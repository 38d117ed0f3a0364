"""`scripts/setup.sh`: its friendly failures and its no-op second run, each in a temporary copy of the checkout.

No network: pip is pointed at a closed local port (PIP_INDEX_URL=http://127.0.0.1:9/, no retries, a 1 s timeout)
and the extra indexes, wheel folders and constraints of this machine's pip configuration are switched off. The
"system" Python is this interpreter's base (no virtual environment); a torch it should see is a stand-in package
on PYTHONPATH (its metadata, and a CUDA library file for a CUDA build) whose import fails, since the script must
tell the build without importing torch.

- Python older than 3.11 (a fake interpreter reporting 3.10), a missing one, a .venv made with 3.10;
- pip that cannot reach its index (one line naming the host, in seconds), and a pip failure that is not that;
- a CUDA torch that TORCH_SPEC's CPU pin would bypass (a fresh venv) or replace (a venv that sees it), and the
  same settings with a CPU torch, or a CUDA torch the pin already accepts, going on to pip;
- after a real install (offline, the project alone), a second run that is a no-op: under 5 s and without pip (a
  `pip` that fails comes first on the path), while a changed setting or pyproject.toml runs pip again.

Each failure is one line on stderr, nothing on stdout, exit status 2."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from site_standin import system_site

ROOT = Path(__file__).resolve().parents[2]
BASE_PYTHON = str(Path(sys.base_prefix) / "bin" / "python3")
"""An interpreter that is no virtual environment, standing for the machine's Python."""
OFFLINE_PIP = {
    "PIP_INDEX_URL": "http://127.0.0.1:9/",
    "PIP_EXTRA_INDEX_URL": "",
    "PIP_FIND_LINKS": "",
    "PIP_CONSTRAINT": "",
    "PIP_RETRIES": "0",
    "PIP_TIMEOUT": "1",
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
}
"""pip without its index, failing at once; an empty value overrides the same key of pip's configuration files."""


def _copy(target: Path, paths: list[str] | None = None) -> Path:
    """A copy of the tracked files (or of `paths` among them) standing for a fresh checkout."""
    files = subprocess.run(["git", "ls-files", "-z", *(paths or [])], cwd=ROOT, capture_output=True, check=True).stdout
    archive = subprocess.run(["tar", "cf", "-", "--null", "-T", "-"], cwd=ROOT, input=files, capture_output=True)
    target.mkdir()
    subprocess.run(["tar", "xf", "-"], cwd=target, input=archive.stdout, check=True)
    return target


def _small_checkout(tmp_path: Path) -> Path:
    return _copy(tmp_path / "checkout", ["pyproject.toml", "scripts/setup.sh"])


def _setup(checkout: Path, pythonpath: str = "", **env: str) -> subprocess.CompletedProcess[str]:
    home = checkout.parent / "home"
    home.mkdir(exist_ok=True)
    environ = {"PATH": os.environ["PATH"], "HOME": str(home), "PYTHONPATH": pythonpath, "PYTHON": BASE_PYTHON}
    environ |= OFFLINE_PIP | env
    return subprocess.run(
        ["bash", "scripts/setup.sh"], cwd=checkout, env=environ, capture_output=True, text=True, timeout=300
    )


def _bare_venv(checkout: Path) -> None:
    """The .venv `TORCH_SPEC= bash scripts/setup.sh` makes (it sees the system's packages), without a pip of its
    own (the system's serves): made in a tenth of a second, where ensurepip takes seconds to tens of seconds on a
    loaded machine. The test of a CPU torch below has setup.sh make its venv itself."""
    subprocess.run(
        [BASE_PYTHON, "-m", "venv", "--without-pip", "--system-site-packages", ".venv"], cwd=checkout, check=True
    )


def _one_line_exit_2(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stdout[-2000:], result.stderr[-2000:])
    assert result.stdout == ""
    assert result.stderr.startswith("setup.sh: ") and result.stderr.endswith("\n")
    assert result.stderr.count("\n") == 1, result.stderr[-2000:]
    return result.stderr


def _fake_python(path: Path, version: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\necho "Python {version}"\n')
    path.chmod(0o755)
    return path


def _torch_site(directory: Path, version: str, cuda_library: bool) -> Path:
    """A site directory holding a stand-in torch: its metadata and, for a CUDA build, `lib/libtorch_cuda.so`."""
    (directory / "torch" / "lib").mkdir(parents=True)
    (directory / "torch" / "__init__.py").write_text("raise ImportError('a stand-in torch, not to be imported')\n")
    if cuda_library:
        (directory / "torch" / "lib" / "libtorch_cuda.so").write_bytes(b"")
    info = directory / f"torch-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    return directory


def test_python_older_than_3_11_is_one_line(tmp_path: Path) -> None:
    checkout = _small_checkout(tmp_path)
    old = _fake_python(tmp_path / "bin" / "python3", "3.10.14")
    line = _one_line_exit_2(_setup(checkout, PYTHON=str(old)))
    assert f"{old} is Python 3.10; the project needs 3.11 or newer" in line and "PYTHON=" in line
    assert not (checkout / ".venv").exists()

    line = _one_line_exit_2(_setup(checkout, PYTHON=str(tmp_path / "nowhere" / "python3")))
    assert "no Python interpreter" in line and "install Python 3.11 or newer" in line

    # a .venv made earlier with Python 3.10: the user removes it (the script never deletes what it did not write)
    _fake_python(checkout / ".venv" / "bin" / "python", "3.10.14")
    line = _one_line_exit_2(_setup(checkout))
    assert ".venv/bin/python is Python 3.10" in line and "remove .venv" in line
    assert (checkout / ".venv" / "bin" / "python").exists()


def test_wheels_that_is_no_directory_is_one_line(tmp_path: Path) -> None:
    checkout = _small_checkout(tmp_path)
    line = _one_line_exit_2(_setup(checkout, WHEELS="no-such-dir"))
    assert "WHEELS=no-such-dir is not a directory" in line
    assert not (checkout / ".venv").exists()


def test_pip_without_its_index_is_one_line_and_fast(tmp_path: Path) -> None:
    checkout = _small_checkout(tmp_path)
    _bare_venv(checkout)
    # a reachable index that lacks the package: pip's own failure is shown, not the network line
    empty_index = tmp_path / "index"
    empty_index.mkdir()
    missing = _setup(checkout, PIP_INDEX_URL=empty_index.as_uri())
    assert missing.returncode == 1, (missing.stdout[-2000:], missing.stderr[-2000:])
    assert missing.stderr.endswith("setup.sh: pip install torch==2.13.0 failed (pip's output above)\n")
    assert "torch" in missing.stderr.splitlines()[0] and "cannot reach" not in missing.stderr  # pip's own words
    assert (checkout / ".venv" / "bin" / "python").exists() and not (checkout / ".venv" / ".setup-stamp").exists()

    start = time.monotonic()
    result = _setup(checkout)
    seconds = time.monotonic() - start
    line = _one_line_exit_2(result)
    assert "pip cannot reach its package index (127.0.0.1:9)" in line and "WHEELS=DIR" in line
    assert seconds < 60, seconds
    print(f"no index: {seconds:.1f} s")


def test_cuda_torch_that_a_cpu_pin_would_bypass_is_one_line(tmp_path: Path) -> None:
    checkout = _small_checkout(tmp_path)
    for version, library in (("2.11.0+cu130", True), ("2.11.0", True)):  # a PyTorch-index build, a PyPI one
        site_dir = _torch_site(tmp_path / f"cuda-{version}", version, cuda_library=library)
        line = _one_line_exit_2(_setup(checkout, str(site_dir)))
        assert f"has a CUDA torch ({version}), but TORCH_SPEC=torch==2.13.0 would install another torch" in line
        assert "TORCH_SPEC= bash scripts/setup.sh" in line
        assert not (checkout / ".venv").exists()
    # the same settings with a CPU torch go on: the venv is made and pip runs (and finds no index)
    cpu = _torch_site(tmp_path / "cpu", "2.13.0+cpu", cuda_library=False)
    assert "pip cannot reach" in _one_line_exit_2(_setup(checkout, str(cpu)))


def test_cuda_torch_that_a_cpu_pin_would_replace_in_the_venv_is_one_line(tmp_path: Path) -> None:
    checkout = _small_checkout(tmp_path)
    cuda = str(_torch_site(tmp_path / "cuda", "2.11.0+cu130", cuda_library=True))
    _bare_venv(checkout)  # it sees the system's packages, as `TORCH_SPEC= bash scripts/setup.sh` makes it
    line = _one_line_exit_2(_setup(checkout, cuda))
    assert ".venv sees a CUDA torch (2.11.0+cu130) that TORCH_SPEC=torch==2.13.0 would replace" in line
    # a pin the CUDA torch already satisfies installs no torch: pip goes on to the project (and finds no index)
    assert "pip cannot reach" in _one_line_exit_2(_setup(checkout, cuda, TORCH_SPEC="torch==2.11.0"))


def _failing_pip(directory: Path, marker: Path) -> Path:
    """A `pip` package that records that it ran and fails: first on PYTHONPATH, it is what `python -m pip` runs."""
    (directory / "pip").mkdir(parents=True)
    (directory / "pip" / "__init__.py").write_text("")
    (directory / "pip" / "__main__.py").write_text(
        f"import pathlib, sys\npathlib.Path({str(marker)!r}).touch()\nsys.exit(3)\n"
    )
    return directory


def test_second_run_is_a_no_op(tmp_path: Path) -> None:
    checkout = _copy(
        tmp_path / "checkout", ["pyproject.toml", "README.md", "scripts", "hf_mcore_bridge", "cli", "mappings"]
    )
    (checkout / "wheels").mkdir()
    system = str(system_site(tmp_path / "system", ("hf_mcore_bridge", "__editable__")))
    _bare_venv(checkout)  # so that the first, real install is the project's editable install alone
    settings = {"TORCH_SPEC": "", "EXTRAS": "", "WHEELS": "wheels", "PIP_NO_INDEX": "1"}
    first = _setup(checkout, system, **settings)
    assert first.returncode == 0, first.stderr[-2000:]
    assert (checkout / ".venv" / ".setup-stamp").is_file()

    marker = tmp_path / "pip-ran"
    no_pip = f"{_failing_pip(tmp_path / 'no-pip', marker)}{os.pathsep}{system}"
    start = time.monotonic()
    second = _setup(checkout, no_pip, **settings)
    seconds = time.monotonic() - start
    assert second.returncode == 0, second.stderr[-2000:]
    assert "already set up" in second.stdout and not marker.exists()
    assert seconds < 5, seconds
    print(f"second run: {seconds:.2f} s")

    # what the stamp covers: another setting, or another pyproject.toml, installs again (here: the failing pip,
    # after which the stamp is gone; it is put back between the two)
    stamp = (checkout / ".venv" / ".setup-stamp").read_text()
    changed = _setup(checkout, no_pip, **settings | {"EXTRAS": "data"})
    assert changed.returncode != 0 and marker.exists()
    assert not (checkout / ".venv" / ".setup-stamp").exists()
    marker.unlink()
    (checkout / ".venv" / ".setup-stamp").write_text(stamp)
    assert _setup(checkout, no_pip, **settings).returncode == 0 and not marker.exists()
    with (checkout / "pyproject.toml").open("a") as pyproject:
        pyproject.write("# edited\n")
    edited = _setup(checkout, no_pip, **settings)
    assert edited.returncode != 0 and marker.exists()
