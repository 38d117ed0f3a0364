"""Starting the process world for megatron-core: spawned locally, or the one a launcher such as `torchrun` started.

`run_world(fn, layout, *args)` runs `fn(*args)` on TP x PP x CP x EP ranks (or `world=` ranks: the data-parallel
size is then `world / (TP x PP x CP)`, megatron-core's rule); each rank initialises `torch.distributed` and
megatron-core's `parallel_state` for the layout (CPU workarounds applied where CUDA is absent), calls `fn(*args)`,
and tears down. `run_torch_world(fn, size, *args)` starts the same kind of world without megatron-core's state, for
backends that lay out their own device mesh (DTensor). gloo on CPU, NCCL on GPU.

Two ways in:
- Under an env:// launcher (`torchrun`: `WORLD_SIZE`, `RANK`, `LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT` set), the
  current process is one rank of the world it was given: it joins it (`join_launched_world`), checks its size and
  runs `fn` itself. Stopping is then the launcher's business; SIGINT and SIGTERM take their default action inside
  `fn` (the rank ends at once, without a traceback). An error every rank finds alike (a world of the wrong size)
  is raised by `fail_alike`: global rank 0 reports it, the others wait for the launcher to stop them first (it
  stops a node's ranks once one has failed, and must not stop rank 0 before its line is out), then exit silently.
- Otherwise the ranks are spawned processes on this host (127.0.0.1). `fn` must be importable (a module-level
  function); a failing rank becomes a `BridgeError` carrying its last error line. The launcher (this process)
  owns the ranks: SIGINT or SIGTERM sent to it terminates every rank's process group (grandchildren included),
  escalates to SIGKILL after `STOP_GRACE_S`, and raises `RunStopped`; each rank ignores SIGINT (a terminal's
  Ctrl-C reaches the launcher, which decides), dies on SIGTERM by the default action (no Python handler, so no
  traceback and no wait for a collective to return) and, through Linux's `PR_SET_PDEATHSIG`, dies with SIGKILL if
  the launcher dies. The handlers are installed explicitly, so a launcher started in the background by a script
  (where the shell makes it ignore SIGINT) is stopped by SIGINT all the same. `stop_on_signals` puts the same
  handlers around a caller's own work before the world starts (e.g. converting the policy).

Spawned ranks are forked from a fork server (`multiprocessing`'s forkserver, on Linux) that has imported torch,
megatron-core and transformers once (`FORKSERVER_PRELOAD`): a rank starts in milliseconds instead of importing them
again, and ranks share those pages. The fork server is a clean interpreter started once per launcher process (not a
fork of the launcher: no CUDA context, no threads), so each rank begins as a spawned one would, except that it is
handed the launcher's environment as it is when the world starts (`os.environ` is copied in, the fork server's own
being that of its start). It ends with the launcher, and its ranks with it (`PR_SET_PDEATHSIG`). Elsewhere, and on
machines with a CUDA device, ranks are spawned: there a preloaded library (megatron-core 0.19, for one) initialises
CUDA in the fork server as it imports, and a forked child of a process with CUDA initialised cannot use CUDA.

Made of torch's own pieces: the ranks are started by `torch.multiprocessing.start_processes` and joined by its
context (which also turns a rank's exception into `ProcessRaisedException`), a launched world is torchrun's
env:// protocol. What is written here is the stopping, which torch's context does not do (it stops no rank when
the launcher gets SIGINT or SIGTERM, and ranks outlive a killed launcher). torch's elastic launcher
(`elastic_launch`, what torchrun runs) does stop its workers, but it is built for fault-tolerant jobs: a
rendezvous, a TCP store, restarts and per-rank error files around every call; the handlers above are the part of
that this project needs (the whole world stopped, the ranks' own children included, and ranks that die with
their launcher), in under a hundred lines.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from hf_mcore_bridge.convert.layout import Layout, check_world, world_size
from hf_mcore_bridge.errors import BridgeError, LayoutError, RunStopped, WorldError
from hf_mcore_bridge.megatron.process_death import die_with_parent, forked_children_die_with_this_process

LAUNCHER_ENV = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What an env:// launcher (`torchrun`) sets for each rank it starts."""

STOP_GRACE_S = 5.0
"""Seconds spawned ranks get to end after SIGTERM before SIGKILL."""

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)

FORKSERVER_PRELOAD = (
    "hf_mcore_bridge.megatron.fork_server",  # first: the server dies with its launcher from here on
    "torch",
    "torch.distributed",
    "transformers",
    "megatron.core",
    "hf_mcore_bridge.megatron.model",
)
"""What the fork server imports before it forks ranks (a module that fails to import is left to each rank)."""

REPORT_GRACE_S = 30.0
"""How long a rank other than global rank 0 waits before it exits after an error every rank meets alike: on rank 0's
node the launcher stops it sooner (once rank 0 has reported and failed); elsewhere it then exits by itself."""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LaunchedWorld:
    """The world an env:// launcher started this process in."""

    rank: int
    """Global rank."""
    size: int
    """All ranks, over every node."""
    local_rank: int
    """This node's index of the rank (its GPU)."""


def launched_world() -> LaunchedWorld | None:
    """This process's place in a launcher's world (all of `LAUNCHER_ENV` set), or None: ranks are spawned here."""
    if not all(os.environ.get(name) for name in LAUNCHER_ENV):
        return None
    try:
        return LaunchedWorld(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"]))
    except ValueError:
        raise BridgeError(
            "RANK, WORLD_SIZE and LOCAL_RANK must be integers (as torchrun sets them), got "
            + ", ".join(f"{name}={os.environ[name]!r}" for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
        ) from None


def check_launched_size(expected: int, what: str) -> None:
    """Under a launcher, raise `WorldError` (`fail_alike`) unless it started `expected` ranks; `what` says where
    the number comes from (named in the message)."""
    launched = launched_world()
    if launched is not None and launched.size != expected:
        fail_alike(f"the launcher started WORLD_SIZE={launched.size} ranks but {what} needs {expected}")


def fail_alike(message: str) -> NoReturn:
    """Raise the `WorldError` of an error every rank meets alike: the reporting one on global rank 0 (and where
    ranks are spawned here); on any other rank of a launcher's world a silent one, after `REPORT_GRACE_S` seconds in
    which the launcher, once rank 0 has reported and failed, normally stops this rank (SIGTERM's default action)."""
    launched = launched_world()
    if launched is None or launched.rank == 0:
        raise WorldError(message, reports=True)
    time.sleep(REPORT_GRACE_S)
    raise WorldError(message, reports=False)


def reports_here() -> bool:
    """Whether this process reports a command's result: always when ranks are spawned here, on global rank 0 only
    under a launcher (every rank runs the command)."""
    launched = launched_world()
    return launched is None or launched.rank == 0


def join_launched_world() -> LaunchedWorld:
    """Initialise `torch.distributed` from the launcher's env:// rendezvous (once; later calls return at once)."""
    import torch.distributed as dist

    launched = launched_world()
    if launched is None:
        raise BridgeError("not started by an env:// launcher: " + ", ".join(LAUNCHER_ENV) + " must be set")
    if not dist.is_initialized():
        forked_children_die_with_this_process()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(launched.local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    return launched


def device() -> torch.device:
    """This rank's device."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def run_world(fn: Callable[..., None], layout: Layout, *args: Any, world: int | None = None) -> None:
    """Run `fn(*args)` on every rank of a world for `layout`: `world` ranks, or None: `world_size(layout)` spawned
    here, or as many as the launcher started."""
    launched = launched_world()
    if world is None:
        size = world_size(layout) if launched is None else launched.size
    else:
        check_launched_size(world, f"the run ({layout})")
        size = world
    try:
        check_world(layout, size)
    except LayoutError as err:
        if launched is None:
            raise
        fail_alike(str(err))
    _start(size, layout, fn, args)


def run_torch_world(fn: Callable[..., None], size: int, *args: Any) -> None:
    """Run `fn(*args)` on `size` ranks with `torch.distributed` initialised and no megatron-core state (worlds
    laid out by the caller, e.g. DTensor device meshes)."""
    check_launched_size(size, "the run")
    _start(size, None, fn, args)


def _start(size: int, layout: Layout | None, fn: Callable[..., None], args: tuple) -> None:
    if launched_world() is None:
        _spawn(size, layout, fn, args)
        return
    join_launched_world()
    # the launcher stops the ranks: end at once, without a traceback (a Python handler would wait for the
    # collective in progress to return); handlers can be set from the main thread only
    main = threading.current_thread() is threading.main_thread()
    previous = {signum: signal.signal(signum, signal.SIG_DFL) for signum in STOP_SIGNALS} if main else {}
    try:
        _rank_body(layout, fn, args)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _spawn(size: int, layout: Layout | None, fn: Callable[..., None], args: tuple) -> None:
    import torch.multiprocessing as mp

    processes: list[Any] = []  # filled once started; the handlers are in place before the first rank starts
    try:
        with stop_on_signals(processes):
            with _sigint_ignored_by_new_ranks():  # the fork server, if started now, ignores SIGINT from its start
                method, parent = _start_method()
            if method == "forkserver":
                _wait_for_fork_server()  # its imports take seconds: a Ctrl-C meanwhile stops the launcher
            with _sigint_ignored_by_new_ranks():
                context = mp.start_processes(
                    _rank_main,
                    args=(size, _free_port(), os.getpid(), parent, dict(os.environ), layout, fn, args),
                    nprocs=size,
                    join=False,
                    start_method=method,
                )
            processes.extend(context.processes)
            while not context.join():
                pass
    except mp.ProcessRaisedException as err:
        text = str(err).strip()
        detail = text if os.environ.get("BRIDGE_DEBUG") == "1" else text.splitlines()[-1]
        raise BridgeError(f"a rank failed: {detail}") from None
    except mp.ProcessExitedException as err:
        raise BridgeError(f"a rank died: {err}") from None


def _start_method() -> tuple[str, int]:
    """How ranks start here, and the pid their parent process has: the fork server's on Linux (started now if it
    is not running), else spawn's (this process): off Linux, and where CUDA is available (see the module docstring)."""
    if sys.platform != "linux" or torch.cuda.is_available():
        return "spawn", os.getpid()
    from multiprocessing import forkserver

    forkserver.set_forkserver_preload(list(FORKSERVER_PRELOAD))
    forkserver.ensure_running()
    return "forkserver", forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


def _wait_for_fork_server() -> None:
    """Return once the fork server has done its imports and forks: one process forked through it that exits at
    once. Waited for with the launcher's own SIGINT and SIGTERM handlers in place (`stop_on_signals`)."""
    import multiprocessing

    probe = multiprocessing.get_context("forkserver").Process(target=_exit_at_once, daemon=True)
    probe.start()
    probe.join()


def _exit_at_once() -> None:
    os._exit(0)


@contextlib.contextmanager
def _sigint_ignored_by_new_ranks() -> Iterator[None]:
    """SIGINT ignored while ranks are started: the disposition survives spawn's exec, so a Ctrl-C to the process
    group that lands while a rank is still starting Python (before `_follow_launcher`) cannot print a
    KeyboardInterrupt traceback from it. The launcher's own handler is back once the ranks are started."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def stop_on_signals(processes: list[Any] | None = None) -> Iterator[None]:
    """Inside, SIGINT / SIGTERM raise `RunStopped`, after stopping `processes` (spawned ranks) if given. Main
    thread only (Python delivers signals there; elsewhere this does nothing). Nests: the outer handlers come back
    on leaving."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, _frame: Any) -> None:
        raise RunStopped(signum)

    previous = {signum: signal.signal(signum, stop) for signum in STOP_SIGNALS}
    try:
        yield
    except RunStopped:
        for signum in STOP_SIGNALS:  # a second Ctrl-C must not cut the stopping short
            signal.signal(signum, signal.SIG_IGN)
        _stop_ranks(processes or [])
        raise
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_ranks(processes: list[Any]) -> None:
    """SIGTERM to every rank's process group, SIGKILL to what is left after `STOP_GRACE_S`; reap the ranks."""
    _signal_groups(processes, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    _signal_groups(processes, signal.SIGKILL)  # also what a rank started (its group outlives it)
    for process in processes:
        process.join()


def _signal_groups(processes: list[Any], signum: int) -> None:
    for process in processes:
        try:
            os.killpg(process.pid, signum)  # the group each rank made itself (`_follow_launcher`)
        except (ProcessLookupError, PermissionError):
            if process.exitcode is None:  # stopped before it made its group: signal it alone
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)


def _follow_launcher(launcher: int, parent: int) -> None:
    """Make a spawned rank stoppable by its launcher alone and end with it (see the module docstring): `parent` is
    the process it was started from (the launcher, or the fork server, which ends with the launcher)."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    die_with_parent(parent)
    if not _alive(launcher):  # it died before the line above took effect
        os._exit(1)
    forked_children_die_with_this_process()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _rank_main(
    rank: int,
    size: int,
    port: int,
    launcher: int,
    parent: int,
    environment: dict[str, str],
    layout: Layout | None,
    fn: Callable[..., None],
    args: tuple,
) -> None:
    import torch.distributed as dist

    _follow_launcher(launcher, parent)
    os.environ.clear()  # the launcher's, as the world starts (a fork server's own is that of its start)
    os.environ.update(environment, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = torch.cuda.is_available()
    if not cuda and "OMP_NUM_THREADS" not in environment:  # the host's cores shared out, not each rank taking all
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=size)
    _rank_body(layout, fn, args)


def initialize_parallel_state(layout: Layout) -> None:
    """megatron-core's `parallel_state` for `layout` over the initialised default process group."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp,
        pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp,
        context_parallel_size=layout.cp,
        expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp,
    )


def _rank_body(layout: Layout | None, fn: Callable[..., None], args: tuple) -> None:
    """On a rank whose default process group is up: megatron-core's state for `layout`, `fn(*args)`, teardown."""
    import torch.distributed as dist

    from hf_mcore_bridge.megatron.cpu_patches import (
        apply_cpu_workarounds,
        apply_fla_absent_workarounds,
        apply_te_absent_workarounds,
    )
    from hf_mcore_bridge.quiet import quiet_libraries

    quiet_libraries()
    if layout is None:
        try:
            fn(*args)
        finally:
            dist.destroy_process_group()
        return
    apply_cpu_workarounds()
    apply_te_absent_workarounds()
    apply_fla_absent_workarounds()
    from megatron.core import parallel_state

    initialize_parallel_state(layout)
    if torch.cuda.is_available():
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(0)
    try:
        fn(*args)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
