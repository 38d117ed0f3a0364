"""Makes the fork server that starts local ranks (`world.FORKSERVER_PRELOAD`) end the moment its launcher does.

The standard library's fork server leaves when it reads EOF from its launcher, through a normal interpreter exit,
which with torch, megatron-core and transformers loaded takes seconds; its ranks, which die with it
(`PR_SET_PDEATHSIG`), would outlive a killed launcher that long. Imported by the fork server as it preloads, this
module asks the kernel to SIGKILL the server with its parent (the launcher), so the ranks go at once too. Imported
anywhere else it does nothing: it acts only when `multiprocessing.forkserver.main` is on the call stack.
"""

from __future__ import annotations

import sys
from multiprocessing import forkserver

from hf_mcore_bridge.megatron.process_death import die_with_parent


def in_fork_server() -> bool:
    """Whether this import runs inside `multiprocessing.forkserver.main` (the fork server's preload)."""
    frame = sys._getframe()
    while frame is not None:
        if frame.f_code is forkserver.main.__code__:
            return True
        frame = frame.f_back
    return False


if in_fork_server():
    die_with_parent()
