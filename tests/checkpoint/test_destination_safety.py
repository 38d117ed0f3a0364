"""Where outputs may go (issue 17, requirements 1, 5 and 6), for every writing command.

Each refusal is checked three ways: exit status 2, one line naming the problem, and the whole test directory
(sources, destination and everything beside them) byte-for-byte as before, by a snapshot of paths and sha256 taken
here. Signals are real: a child process converts with its writes paused mid-way, and is sent SIGTERM, SIGINT or
SIGKILL.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from hf_mcore_bridge.cli.main import app
from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore

REPO = Path(__file__).resolve().parents[2]
MARKER = ".hf-mcore-bridge.json"
runner = CliRunner()


def run(*args: object):
    return runner.invoke(app, [str(a) for a in args])


def snapshot(root: Path) -> dict[str, str]:
    """Every path under `root` (symlinks not followed) with the sha256 of files, the target of links."""
    state = {}
    for path in sorted(root.rglob("*")):
        key = str(path.relative_to(root))
        if path.is_symlink():
            state[key] = "-> " + os.readlink(path)
        elif path.is_file():
            state[key] = hashlib.sha256(path.read_bytes()).hexdigest()
        else:
            state[key] = "dir"
    return state


def assert_refused(result, *fragments: str) -> None:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in result.output, result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def tool_marker(directory: Path, **extra: object) -> None:
    """A marker as this tool writes it, written here by hand (the format is part of the contract)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MARKER).write_text(json.dumps({"written_by": "hf-mcore-bridge", **extra}))


# --- sources of each command ---


@pytest.fixture(scope="module")
def converted(tiny_models, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "mcore"
    convert_hf_to_mcore(tiny_models["llama"], out, layout=Layout(tp=2), show_progress=False)
    return out


def make_run(converted: Path, run_dir: Path) -> Path:
    """A GRPO run as the trainer leaves it: checkpoints at steps 5 and 10 (tracker: 10) and metrics for 10 steps."""
    checkpoints = run_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    for step in (5, 10):
        shutil.copytree(converted / "release", checkpoints / f"iter_{step:07d}")
    shutil.copytree(converted / "hf_assets", checkpoints / "hf_assets")
    (checkpoints / "latest_checkpointed_iteration.txt").write_text("10")
    (run_dir / "logs").mkdir()
    records = [{"step": s, "reward_mean": s / 10, "kl_ref": 0.01} for s in range(1, 11)]
    (run_dir / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


Command = Callable[[Path, Path], list[object]]
COMMANDS: dict[str, tuple[str, Command]] = {
    # name: (source kind, arguments for source -> destination)
    "convert-mcore": ("hf", lambda s, d: ["convert", "--to", "mcore", s, d, "--no-progress"]),
    "convert-hf": ("mcore", lambda s, d: ["convert", "--to", "hf", s, d, "--no-progress"]),
    "export": ("run", lambda s, d: ["export", s, d]),
}


@pytest.fixture(params=list(COMMANDS))
def case(request, tiny_models, converted, tmp_path) -> SimpleNamespace:
    """One writing command with a private source under `tmp_path/work`."""
    kind, args = COMMANDS[request.param]
    work = tmp_path / "work"
    work.mkdir()
    if kind == "hf":
        source = Path(shutil.copytree(tiny_models["llama"], work / "src"))
    elif kind == "mcore":
        source = Path(shutil.copytree(converted, work / "src"))
    else:
        source = make_run(converted, work / "src")
    return SimpleNamespace(name=request.param, work=work, source=source, args=args)


def invoke(case: SimpleNamespace, source: Path, destination: Path, *extra: str):
    return run(*case.args(source, destination), *extra)


# --- requirement 1: a destination never overlaps a source ---


@pytest.mark.parametrize(
    ("where", "message"),
    [
        ("same", "is the source"),
        ("inside", "is inside the source"),
        ("contains", "contains the source"),
        ("symlink", "is inside the source"),
    ],
)
def test_destination_overlapping_a_source_is_refused_even_with_overwrite(case, where, message):
    source = case.source
    if where == "same":
        destination = source
    elif where == "inside":
        destination = source / "out"
    elif where == "contains":
        destination = case.work
        (case.work / "unrelated.txt").write_text("not ours")
    else:  # the destination reaches into the source through a symlink
        (case.work / "link").symlink_to(source)
        destination = case.work / "link" / "out"
    before = snapshot(case.work)
    assert_refused(invoke(case, source, destination, "--overwrite", "--overwrite-foreign"), message)
    assert snapshot(case.work) == before


def test_destination_holding_what_the_source_links_to_is_refused(case):
    """A source whose files are symlinks into another directory (an HF hub cache's snapshot and its `blobs/`):
    that directory is what the source reads, so it may not be the destination, whatever the flags."""
    blobs = case.work / "blobs"
    blobs.mkdir()
    for index, file in enumerate(sorted(p for p in case.source.rglob("*") if p.is_file())):
        file.rename(blobs / f"{index:04d}")
        file.symlink_to(blobs / f"{index:04d}")
    before = snapshot(case.work)
    result = invoke(case, case.source, blobs, "--overwrite", "--overwrite-foreign")
    assert_refused(result, f"destination {blobs} contains {blobs}/", ", which the source links to (")
    assert snapshot(case.work) == before
    assert invoke(case, case.source, case.work / "out").exit_code == 0  # the linked source itself is fine


@pytest.fixture
def mount_point(tmp_path) -> Path:
    """An empty tmpfs mounted at `tmp_path/mnt` (skipped where mounting is not permitted)."""
    target = tmp_path / "mnt"
    target.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(target)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip() or mounted.returncode}")
    try:
        yield target
    finally:
        subprocess.run(["umount", str(target)], check=True)


def test_mount_point_as_destination_is_refused_before_any_work(case, mount_point, monkeypatch):
    """The output is renamed into place, which a mount point cannot take: refused up front, not after the work."""
    from hf_mcore_bridge.convert import to_mcore

    def no_work(*args, **kwargs):
        raise AssertionError("a tensor was produced")

    monkeypatch.setattr(to_mcore.Producer, "chunk", no_work)
    monkeypatch.setattr(to_mcore.Producer, "full", no_work)
    before = snapshot(case.work)
    result = invoke(case, case.source, mount_point, "--overwrite-foreign")
    assert_refused(result, f"destination {mount_point} is a mount point", f"{mount_point / 'model'}")
    assert snapshot(case.work) == before and list(mount_point.iterdir()) == []
    monkeypatch.undo()
    result = invoke(case, case.source, mount_point / "model")
    assert result.exit_code == 0 and (mount_point / "model" / MARKER).exists(), result.output


# --- requirement 1: --overwrite replaces only what this tool wrote ---


def test_foreign_destination_is_refused_with_overwrite_and_replaced_with_overwrite_foreign(case):
    destination = case.work / "out"
    destination.mkdir()
    (destination / "thesis.tex").write_text("years of work")
    before = snapshot(case.work)
    assert_refused(invoke(case, case.source, destination, "--overwrite"), "not written by", "--overwrite-foreign")
    assert snapshot(case.work) == before
    result = invoke(case, case.source, destination, "--overwrite-foreign")
    assert result.exit_code == 0, result.output
    assert not (destination / "thesis.tex").exists() and (destination / MARKER).exists()


def test_tool_output_needs_overwrite_and_is_then_replaced(case):
    destination = case.work / "out"
    result = invoke(case, case.source, destination)
    assert result.exit_code == 0, result.output
    marker = json.loads((destination / MARKER).read_text())
    assert marker["written_by"] == "hf-mcore-bridge" and marker["sources"] == [str(case.source.resolve())]
    (destination / "stale.txt").write_text("from the first run")
    before = snapshot(case.work)
    assert_refused(invoke(case, case.source, destination), "not empty", "--overwrite")
    assert snapshot(case.work) == before
    result = invoke(case, case.source, destination, "--overwrite")
    assert result.exit_code == 0, result.output
    assert not (destination / "stale.txt").exists()
    # Nothing is left beside the destination: no partial, no replaced copy, no lock file.
    assert sorted(p.name for p in case.work.iterdir()) == ["out", "src"]


def test_destination_through_a_symlink_is_written_where_it_points(case):
    real = case.work / "real"
    assert invoke(case, case.source, real).exit_code == 0
    (real / "stale.txt").write_text("from the first run")
    (case.work / "link").symlink_to(real)
    result = invoke(case, case.source, case.work / "link", "--overwrite")
    assert result.exit_code == 0, result.output
    assert os.readlink(case.work / "link") == str(real) and not (real / "stale.txt").exists()
    assert (real / MARKER).exists() and sorted(p.name for p in case.work.iterdir()) == ["link", "real", "src"]


def test_a_file_as_destination_is_refused(case):
    destination = case.work / "out"
    destination.write_text("a file")
    before = snapshot(case.work)
    assert_refused(invoke(case, case.source, destination, "--overwrite-foreign"), "not a directory")
    assert snapshot(case.work) == before


def test_failed_swap_puts_the_old_output_back(case, monkeypatch):
    destination = case.work / "out"
    assert invoke(case, case.source, destination).exit_code == 0
    before = snapshot(case.work)
    rename = Path.rename

    def refuse_the_new_one(self, target):  # renaming the old output aside works; putting the new one in fails
        if self.name.startswith(".out.partial-") and Path(target) == destination.resolve():
            raise OSError(16, "Device or resource busy")
        return rename(self, target)

    monkeypatch.setattr(Path, "rename", refuse_the_new_one)
    assert_refused(invoke(case, case.source, destination, "--overwrite"), "could not put the output in place")
    assert snapshot(case.work) == before


def test_a_symlink_loop_inside_a_source_is_passed_over(case):
    """A link inside a source that leads nowhere (a loop) cannot overlap the destination: the command runs (it
    used to end in `internal error: RuntimeError: Symlink loop`), and the link is left as it was."""
    (case.source / "loop_a").symlink_to("loop_b")
    (case.source / "loop_b").symlink_to("loop_a")
    result = invoke(case, case.source, case.work / "out")
    assert result.exit_code == 0, result.output
    assert os.readlink(case.source / "loop_a") == "loop_b" and (case.work / "out" / MARKER).exists()


@pytest.mark.parametrize(
    ("destination", "message"),
    [
        ("loop/out", "destination: {work}/loop/out cannot be followed: symlinks in it form a loop"),
        ("x" * 300, "holds a name of 300 bytes; the file system takes at most 255"),
        ("z" * 240, "its name is 240 bytes long, but the output is built in a hidden sibling named"),
    ],
    ids=["inside-a-loop", "name-too-long", "no-room-for-the-staging-sibling"],
)
def test_a_destination_the_file_system_cannot_take_is_refused_by_the_library(case, destination, message):
    """The library's own check (what the command line checks up front, for callers of the Python API): one
    `BridgeError` naming the problem, before the lock, the staging sibling or anything else exists."""
    from hf_mcore_bridge.checkpoint.atomic import atomic_directory
    from hf_mcore_bridge.errors import BridgeError

    (case.work / "loop").symlink_to("loop")
    before = snapshot(case.work)
    with pytest.raises(BridgeError) as refused, atomic_directory(case.work / destination, sources=[case.source]):
        pass
    assert message.format(work=case.work) in str(refused.value) and "\n" not in str(refused.value)
    assert snapshot(case.work) == before


# --- requirement 5: the lock and the leftovers of interrupted runs ---


def test_destination_locked_by_another_run_is_refused(case):
    destination = case.work / "out"
    lock = case.work / ".out.lock"
    with lock.open("w") as handle:  # another run holding the lock, taken here with fcntl directly
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.write("4242\n")
        handle.flush()
        before = snapshot(case.work)
        assert_refused(invoke(case, case.source, destination), "another run", "pid 4242")
        assert snapshot(case.work) == before


def test_stale_partials_are_removed_or_reported(case):
    destination = case.work / "out"
    stale = case.work / ".out.partial-0123abcd"
    tool_marker(stale)
    (stale / "half.distcp").write_bytes(b"\0" * 1000)
    empty = case.work / ".out.partial-89abcdef"
    empty.mkdir()
    unmarked = case.work / ".out.partial-deadbeef"  # our naming, but no marker: not ours to delete
    unmarked.mkdir()
    (unmarked / "notes.txt").write_text("someone's")
    other = case.work / ".other.partial-0123abcd"  # another destination's: not touched
    tool_marker(other)
    result = invoke(case, case.source, destination)
    assert result.exit_code == 0, result.output
    assert not stale.exists() and not empty.exists()
    assert (unmarked / "notes.txt").read_text() == "someone's" and other.exists()
    notes = [line for line in result.output.splitlines() if line.startswith("note: ")]
    assert len(notes) == 3 and sum("removed" in n for n in notes) == 2 and "left" in notes[2], result.output


def test_replaced_output_whose_swap_was_interrupted_is_restored(case):
    """A run killed between renaming the old output aside and renaming the new one in: the old one comes back."""
    destination = case.work / "out"
    aside = case.work / ".out.old-0123abcd"
    tool_marker(aside)
    (aside / "weights").write_text("the previous output")
    before = snapshot(aside)
    result = invoke(case, case.source, destination)
    assert result.exit_code == 2, result.output
    note, error = [line for line in result.output.splitlines() if line.strip()]
    assert note.startswith("note: restored") and error.startswith("error: ") and "--overwrite" in error
    assert snapshot(destination) == before and not aside.exists()


# --- requirement 5: signals during a conversion, in a real child process ---

CHILD = """
import signal, sys, time
from pathlib import Path
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in an interactive shell, even if started ignoring it
from hf_mcore_bridge.checkpoint import byte_copy
flag, source, destination = sys.argv[1:]
def paused(self):  # every write into the output waits here, as if the disk never answered, until stopped
    Path(flag).touch()  # the staging directory exists and is being written
    while not self.stop.is_set():
        time.sleep(0.05)
    raise byte_copy.Stopped
byte_copy._Output.check = paused
from hf_mcore_bridge.cli.main import app
sys.argv = ["bridge", "convert", "--to", "mcore", "--no-progress", source, destination]
app()
"""


def start_paused_conversion(source: Path, destination: Path, flag: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(flag), str(source), str(destination)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "the child never started writing"
        time.sleep(0.1)
    return child


@pytest.mark.parametrize(("signum", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_during_conversion_removes_the_partial(tiny_models, tmp_path, signum, status):
    source = Path(shutil.copytree(tiny_models["llama"], tmp_path / "src"))
    before = snapshot(source)
    child = start_paused_conversion(source, tmp_path / "out", tmp_path / "writing")
    (partial,) = tmp_path.glob(".out.partial-*")  # the work in progress, seen from outside
    assert (partial / MARKER).exists()
    child.send_signal(signum)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == status, stderr
    assert stderr.strip().splitlines()[-1] == "interrupted; nothing was written to the destination"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "writing"]  # no output, partial or lock
    assert snapshot(source) == before


def test_killed_conversion_holds_the_lock_and_its_partial_is_removed_next_time(tiny_models, tmp_path):
    source = Path(shutil.copytree(tiny_models["llama"], tmp_path / "src"))
    destination = tmp_path / "out"
    child = start_paused_conversion(source, destination, tmp_path / "writing")
    try:
        second = run("convert", "--to", "mcore", source, destination, "--no-progress")
        assert_refused(second, "another run", f"pid {child.pid}")
    finally:
        child.kill()
        child.communicate(timeout=60)
    assert child.returncode == -signal.SIGKILL
    (partial,) = tmp_path.glob(".out.partial-*")  # what SIGKILL leaves: nothing can run at exit
    result = run("convert", "--to", "mcore", source, destination, "--no-progress")
    assert result.exit_code == 0, result.output
    assert f"note: removed {partial}" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src", "writing"]
    # The output is whole: exported back, every tensor equals the original HF one.
    back = run("convert", "--to", "hf", destination, tmp_path / "back", "--no-progress")
    assert back.exit_code == 0, back.output
    original, exported = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == exported.keys() and all((original[k] == exported[k]).all() for k in original)


# --- requirement 1: bridge demo ---


def test_demo_refuses_a_foreign_directory_and_an_earlier_demo_without_overwrite(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "hf").mkdir()
    (foreign / "hf" / "model.safetensors").write_bytes(b"my own model")
    earlier = tmp_path / "demo"
    tool_marker(earlier, command="demo")
    (earlier / "hf").mkdir()
    before = snapshot(tmp_path)
    assert_refused(run("demo", foreign, "--overwrite"), "not written by", "--overwrite-foreign")
    assert_refused(run("demo", earlier), "not empty", "--overwrite")
    assert snapshot(tmp_path) == before


def test_demo_is_refused_while_locked(tmp_path):
    earlier = tmp_path / "demo"
    tool_marker(earlier, command="demo")
    with (tmp_path / ".demo.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.write("4343\n")
        handle.flush()
        before = snapshot(tmp_path)
        assert_refused(run("demo", earlier, "--overwrite"), "another run", "pid 4343")
        assert snapshot(tmp_path) == before


@pytest.mark.slow
def test_demo_replaces_an_earlier_demo_with_overwrite(tmp_path):
    earlier = tmp_path / "demo"
    tool_marker(earlier, command="demo")
    (earlier / "old.txt").write_text("from an earlier demo")
    stale = tmp_path / ".demo.partial-0123abcd"
    tool_marker(stale, command="demo")
    result = run("demo", earlier, "--tp", "1", "--pp", "1", "--overwrite")
    assert result.exit_code == 0, result.output
    assert f"note: removed {stale}, the unfinished output of an interrupted run" in result.output
    assert "bit-identical" in result.output and str(tmp_path / "demo" / "mcore") in result.output
    assert not (earlier / "old.txt").exists() and (earlier / "hf-back" / "model.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["demo"]


# --- requirement 6: export and the Hub ---


class Hub:
    """Stands in for huggingface_hub.HfApi (no network in tests): records calls, fails where told."""

    def __init__(self, fail: dict[str, Exception] | None = None):
        self.calls: list[tuple[str, dict]] = []
        self.fail = fail or {}

    def __call__(self) -> Hub:
        return self

    def _call(self, name: str, kwargs: dict):
        self.calls.append((name, kwargs))
        if name in self.fail:
            raise self.fail.pop(name)

    def create_repo(self, **kwargs):
        self._call("create_repo", kwargs)

    def upload_folder(self, **kwargs):
        self._call("upload_folder", kwargs)
        return SimpleNamespace(commit_url=f"https://huggingface.co/{kwargs['repo_id']}/commit/1")


@pytest.fixture
def run_dir(converted, tmp_path) -> Path:
    return make_run(converted, tmp_path / "run")


def test_invalid_repo_id_is_refused_before_anything(run_dir, tmp_path, monkeypatch):
    hub = Hub()
    monkeypatch.setattr("huggingface_hub.HfApi", hub)
    before = snapshot(tmp_path)
    assert_refused(run("export", run_dir, tmp_path / "out", "--push-to-hub", "org/bad name"), "not a valid Hub repo")
    assert snapshot(tmp_path) == before and hub.calls == []


def test_unreachable_hub_fails_before_the_local_copy_is_written(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr("huggingface_hub.HfApi", Hub(fail={"create_repo": ConnectionError("no route to host\nmore")}))
    before = snapshot(tmp_path)
    result = run("export", run_dir, tmp_path / "out", "--push-to-hub", "org/tiny")
    assert_refused(result, "org/tiny", "ConnectionError: no route to host")
    assert snapshot(tmp_path) == before


def test_retry_after_a_failed_upload_reuses_the_local_copy(run_dir, tmp_path, monkeypatch):
    out = tmp_path / "out"
    hub = Hub(fail={"upload_folder": TimeoutError("read timed out")})
    monkeypatch.setattr("huggingface_hub.HfApi", hub)
    assert_refused(run("export", run_dir, out, "--push-to-hub", "org/tiny"), "upload to org/tiny failed")
    written = snapshot(tmp_path)
    assert (out / "model.safetensors").exists()
    result = run("export", run_dir, out, "--push-to-hub", "org/tiny")
    assert result.exit_code == 0, result.output
    assert "already holds this export" in result.output and "uploaded: https://huggingface.co/org/tiny" in result.output
    assert snapshot(tmp_path) == written  # not rewritten
    assert [name for name, _ in hub.calls] == ["create_repo", "upload_folder"] * 2
    upload = hub.calls[-1][1]
    assert upload["folder_path"] == str(out) and MARKER in upload["ignore_patterns"]
    # Another step or another card is another export: not reused, and replacing the copy needs --overwrite.
    assert_refused(run("export", run_dir, out, "--step", "5", "--push-to-hub", "org/tiny"), "--overwrite")
    assert_refused(run("export", run_dir, out, "--base-model", "x/y", "--push-to-hub", "org/tiny"), "--overwrite")
    assert snapshot(tmp_path) == written and len(hub.calls) == 4


@pytest.mark.parametrize(("step", "expected"), [(None, 10), (5, 5)])
def test_model_card_names_the_exported_step(run_dir, tmp_path, step, expected):
    out = tmp_path / "out"
    result = run("export", run_dir, out, *(["--step", str(step)] if step else []))
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert f"exported from step {expected}." in card
    rows = [line for line in card.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [int(row.split("|")[1]) for row in rows] == list(range(1, expected + 1))


def test_model_card_shows_this_runs_logs_only(converted, tmp_path):
    """Logs are looked for in the run directory, or beside the checkpoint directory when that is what was given;
    never in other runs: a run without logs gets a card without a reward curve, not another run's."""
    runs = tmp_path / "runs"
    other = make_run(converted, runs / "b")
    (other / "logs" / "grpo_config.yaml").write_text("policy: {model_path: the-other-run}\n")
    bare = runs / "a"
    shutil.copytree(other / "checkpoints", bare / "checkpoints")  # checkpoints only, no logs
    for given, out in ((bare, "card_a"), (bare / "checkpoints", "card_a_ckpt")):
        result = run_export(given, tmp_path / out)
        assert result.exit_code == 0, result.output
        card = (tmp_path / out / "README.md").read_text()
        assert "## Reward" not in card and "the-other-run" not in card, card
        assert not (tmp_path / out / "metrics.jsonl").exists()
    result = run_export(other / "checkpoints", tmp_path / "card_b")  # its own logs, beside its checkpoints
    assert result.exit_code == 0, result.output
    card = (tmp_path / "card_b" / "README.md").read_text()
    assert "## Reward" in card and "the-other-run" in card
    # what the export reads beside the checkpoint directory is a source: the destination may not replace it
    before = snapshot(tmp_path)
    refused = run_export(other / "checkpoints", other / "logs", "--overwrite-foreign")
    assert_refused(refused, f"destination {other / 'logs'} is the source {other / 'logs'}")
    assert snapshot(tmp_path) == before


def run_export(*args: object):
    return run("export", *args)


def test_export_writes_generation_config(run_dir, tmp_path):
    from transformers import GenerationConfig

    assets = run_dir / "checkpoints" / "hf_assets"
    shipped = (assets / "generation_config.json").read_bytes()
    first = tmp_path / "with"
    assert run("export", run_dir, first).exit_code == 0
    assert (first / "generation_config.json").read_bytes() == shipped  # the run's own, as it was
    (assets / "generation_config.json").unlink()
    built = tmp_path / "built"
    result = run("export", run_dir, built)
    assert result.exit_code == 0, result.output
    config = json.loads((assets / "config.json").read_text())
    generation = GenerationConfig.from_pretrained(built)
    assert (generation.bos_token_id, generation.eos_token_id) == (config["bos_token_id"], config["eos_token_id"])
