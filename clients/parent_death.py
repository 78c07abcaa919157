"""Local children die with the process that started them (`interleaf run --local`, the
tests' clusters), asked for by the child itself as it starts.

Not by a `preexec_fn`: that makes subprocess fork() rather than vfork(), which runs
gRPC's fork handlers in the child between fork and exec, and there gRPC's poller can
find its epoll descriptor already closed by close_fds and abort the child before it
execs (measured: 138 of 300 spawns from a process with live channels). The child asks
for the signal first thing instead, and exits if its parent is already gone.
"""

from __future__ import annotations

import ctypes
import os
import signal

PARENT_ENV = "INTERLEAF_DIE_WITH_PARENT"
"""The pid of the process whose death ends this one."""
PR_SET_PDEATHSIG = 1


def die_with_parent_if_asked() -> None:
    """Called at start: SIGTERM this process when the parent named in PARENT_ENV dies."""
    parent = os.environ.pop(PARENT_ENV, "")  # not inherited by this process's own children
    if not parent:
        return
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(parent):  # it died before the request was made: no signal will come
        os._exit(1)
