"""Processes that die with their parent: Linux's `PR_SET_PDEATHSIG` (elsewhere nothing). No heavy imports: the fork
server (`megatron.fork_server`) calls it before it imports torch."""

from __future__ import annotations

import signal
import sys


def die_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux's `PR_SET_PDEATHSIG`; elsewhere nothing). Also
    for helper processes a rank starts (see `grpo.backends.megatron.checkpoint`), which would otherwise outlive a killed
    rank."""
    if sys.platform == "linux":
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
