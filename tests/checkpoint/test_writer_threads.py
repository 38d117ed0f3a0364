"""The conversion's writer threads stop cleanly: on Ctrl-C (a real SIGINT to a real process) and on a write error.

The child converts with every kernel copy slowed down (small steps, a pause per system call), so the run would
take minutes; it records which threads copy. After SIGINT it must end within seconds with status 130 and leave
nothing behind, which it can only do if the workers see the stop between system calls. A failing write in one
worker thread must end the run with the one-line report of that failure, again leaving nothing behind.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from hf_mcore_bridge.checkpoint import byte_copy
from hf_mcore_bridge.cli.main import app

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import os, signal, sys, threading, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive shell, even if started ignoring it
from hf_mcore_bridge.checkpoint import byte_copy
threads, source, destination = sys.argv[1:]
byte_copy.STEP = 1024
real_copy, real_gather = os.copy_file_range, os.pwritev
def slowed(call):
    def run(*args):
        with open(threads, "a") as log:  # which thread copies, and that copying has begun
            log.write(threading.current_thread().name + "\\n")
        time.sleep(0.2)
        return call(*args)
    return run
os.copy_file_range, os.pwritev = slowed(real_copy), slowed(real_gather)
from hf_mcore_bridge.cli.main import app
sys.argv = ["bridge", "convert", "--to", "mcore", "--no-progress", "--tp", "2", source, destination]
app()
"""


def test_sigint_stops_the_writer_threads_at_once(tiny_models, tmp_path):
    source = Path(shutil.copytree(tiny_models["llama"], tmp_path / "src"))
    threads = tmp_path / "threads.log"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(threads), str(source), str(tmp_path / "out")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while len(set(threads.read_text().split()) if threads.exists() else ()) < 2:  # both writers are copying
            assert child.poll() is None, child.communicate()
            assert time.monotonic() < deadline, "the writer threads never started"
            time.sleep(0.1)
        (partial,) = tmp_path.glob(".out.partial-*")
        assert sorted(p.name for p in (partial / "release").glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
        child.send_signal(signal.SIGINT)
        stopped = time.monotonic()
        _, stderr = child.communicate(timeout=30)
    finally:
        child.kill()  # a no-op once it has ended; ends it if it did not stop
    assert time.monotonic() - stopped < 10, "the writers did not stop between system calls"
    assert child.returncode == 130, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted; nothing was written to the destination"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "threads.log"]  # no output, partial or lock
    assert set(threads.read_text().split()) == {"bridge-writer_0", "bridge-writer_1"}  # the executor's names


def test_a_failing_writer_stops_the_run_with_its_error(tiny_models, tmp_path, monkeypatch):
    source = Path(shutil.copytree(tiny_models["llama"], tmp_path / "src"))
    real_copy = os.copy_file_range
    calls: list[str] = []

    def full_disk(src, dst, count, offset_src=None, offset_dst=None):
        calls.append(os.readlink(f"/proc/self/fd/{dst}"))
        if calls[-1].endswith("__0_1.distcp"):
            deadline = time.monotonic() + 30
            while not any(c.endswith("__0_0.distcp") for c in calls) and time.monotonic() < deadline:
                time.sleep(0.01)  # fail only once the other writer is copying too
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_copy(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(byte_copy, "STEP", 4096)
    monkeypatch.setattr(os, "copy_file_range", full_disk)
    result = CliRunner().invoke(app, ["convert", "--to", "mcore", "--no-progress", str(source), str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: no space left on ") and line.endswith("out/release/__0_1.distcp"), line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
    assert any(c.endswith("__0_0.distcp") for c in calls)  # both writers ran
