"""Processes that die with their parent: Linux's `PR_SET_PDEATHSIG` (elsewhere nothing). No heavy imports: the fork
server (`megatron.fork_server`) calls it before it imports torch.

The kernel signals only a parent's death that happens after the request, so a process whose parent dies while it
is still starting (before it asks) would outlive it: `die_with_parent` therefore ends the process at once when its
parent is already gone. Processes a rank forks without exec (megatron-core's checkpoint writers, forked at every
save) ask in the child right after the fork (`forked_children_die_with_this_process`): otherwise a killed rank
leaves them running, and with them the `multiprocessing` resource tracker, which waits for every holder of its pipe.
"""

from __future__ import annotations

import os
import signal
import sys

_forker: int | None = None
"""The pid of the process that is forking (set just before each fork of a process that registered the hooks)."""


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux's `PR_SET_PDEATHSIG`; elsewhere nothing). Also
    for helper processes a rank starts (reward scoring workers, the checkpoint writer's queue manager), which would
    otherwise outlive a killed rank. `parent`: the pid the parent had (default: `multiprocessing`'s parent process,
    where this is one of its processes); if that process is already gone, this one ends here."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if parent is None:
        import multiprocessing

        process = multiprocessing.parent_process()
        parent = process.pid if process is not None else None
    if parent is not None and os.getppid() != parent:  # it died before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


def forked_children_die_with_this_process() -> None:
    """Every process forked from here on by this process, or by its forked children (not those `subprocess` execs),
    dies with its parent. The kernel ties the death signal to the forking thread: a library that forks from a
    thread of its own and lets the thread end first would lose the child; megatron-core's writers fork from the
    caller's thread."""
    if sys.platform == "linux":
        os.register_at_fork(before=_remember_forker, after_in_child=_die_with_forker)


def _remember_forker() -> None:
    global _forker
    _forker = os.getpid()


def _die_with_forker() -> None:
    die_with_parent(_forker)
