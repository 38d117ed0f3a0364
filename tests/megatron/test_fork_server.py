"""The fork server that starts local ranks ends the moment its launcher is killed (`megatron.fork_server`), not
after a normal interpreter exit; importing the module anywhere else changes nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hf_mcore_bridge.megatron import fork_server

LAUNCHER = """
import multiprocessing, sys, time
from multiprocessing import forkserver
forkserver.set_forkserver_preload(sys.argv[1].split(","))
forkserver.ensure_running()
print(forkserver._forkserver._forkserver_pid, flush=True)
time.sleep(600)
"""

SLOW_EXIT = """
import atexit, time
atexit.register(time.sleep, 60)  # a fork server leaving through a normal exit would take a minute
"""


def _server_after_killed_launcher(tmp_path: Path, preload: list[str]) -> psutil.Process:
    (tmp_path / "slow_exit.py").write_text(SLOW_EXIT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, ",".join(preload)], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        server = psutil.Process(int(launcher.stdout.readline()))  # type: ignore[union-attr]
        time.sleep(1)  # the preload done (the server imports two small modules)
    finally:
        launcher.kill()
        launcher.wait()
    return server


def _gone_within(process: psutil.Process, seconds: float) -> bool:
    try:
        process.wait(timeout=seconds)
    except psutil.TimeoutExpired:
        return False
    return True


def test_the_fork_server_dies_with_its_killed_launcher(tmp_path: Path) -> None:
    server = _server_after_killed_launcher(tmp_path, ["slow_exit", "hf_mcore_bridge.megatron.fork_server"])
    assert _gone_within(server, 5)


def test_without_it_a_fork_server_outlives_its_killed_launcher(tmp_path: Path) -> None:
    """The contrast: the standard library's server leaves through a normal exit (here one that takes a minute)."""
    server = _server_after_killed_launcher(tmp_path, ["slow_exit"])
    try:
        assert not _gone_within(server, 3)
    finally:
        server.send_signal(signal.SIGKILL)


def test_imported_elsewhere_it_does_nothing() -> None:
    assert not fork_server.in_fork_server()
    if sys.platform != "linux":
        pytest.skip("PR_GET_PDEATHSIG is Linux's")
    import ctypes

    signum = ctypes.c_int(-1)
    pr_get_pdeathsig = 2
    ctypes.CDLL(None, use_errno=True).prctl(pr_get_pdeathsig, ctypes.byref(signum), 0, 0, 0)
    assert signum.value == 0  # this test process keeps no death signal from the import above
