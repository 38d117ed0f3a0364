"""Processes that die with their parent (`megatron.process_death`), on real processes: a child forked by a process
that asked for it dies when that process is killed (and outlives it when it did not ask: the control), and a child
whose parent is already gone when it asks ends at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")

FORKER = r"""
import os, sys, time
from hf_mcore_bridge.megatron.process_death import forked_children_die_with_this_process
if sys.argv[1] == "ask":
    forked_children_die_with_this_process()
child = os.fork()
if child == 0:
    grandchild = os.fork()  # forked by a forked child: dies with ITS parent, not with the first process
    if grandchild == 0:
        time.sleep(300)
        os._exit(0)
    os.write(1, f"{grandchild}\n".encode())  # one write: the lines cannot interleave
    time.sleep(300)
    os._exit(0)
os.write(1, f"{child}\n".encode())
time.sleep(300)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("ask", [True, False], ids=["asked", "control"])
def test_forked_children_die_with_the_process_that_asked(ask: bool) -> None:
    forker = subprocess.Popen([sys.executable, "-c", FORKER, "ask" if ask else "no"], stdout=subprocess.PIPE, text=True)
    assert forker.stdout is not None
    first, second = sorted(int(forker.stdout.readline()) for _ in range(2))  # the grandchild's line may come first
    child = first if psutil.Process(first).ppid() == forker.pid else second
    grandchild = second if child == first else first
    assert psutil.Process(grandchild).ppid() == child
    try:
        forker.kill()
        forker.wait()
        wait_s = 5 if ask else 1  # the control: still there a second later
        assert _gone_within(child, wait_s) is ask
        assert _gone_within(grandchild, wait_s) is ask  # with its parent (the child), or not at all
    finally:
        for pid in (child, grandchild):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("parent", ["own", "gone"])
def test_a_process_whose_parent_is_already_gone_ends_when_it_asks(parent: str) -> None:
    """`parent` is the pid the caller had; a pid other than its parent's stands for a parent that died (and whose
    orphan was adopted) before the request."""
    code = (
        "import os, sys\n"
        "from hf_mcore_bridge.megatron.process_death import die_with_parent\n"
        "die_with_parent(os.getppid() if sys.argv[1] == 'own' else os.getppid() + 1_000_000)\n"
        "print('still here')\n"
    )
    result = subprocess.run([sys.executable, "-c", code, parent], capture_output=True, text=True, timeout=60)
    if parent == "own":
        assert (result.returncode, result.stdout.strip()) == (0, "still here")
    else:
        assert (result.returncode, result.stdout) == (-signal.SIGKILL, "")
