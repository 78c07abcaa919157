"""gRPC's fork handlers off, in every Interleaf process, before gRPC is first imported.

A process with live gRPC channels that starts a child (a local cluster's coordinator and
stage servers, `ip netns exec`, a compiler) may have gRPC's handlers run in the child
between fork and exec: since grpcio 1.81 they restart gRPC's poller there, which then
finds its epoll descriptor closed by `close_fds` and aborts the child before it execs
("ev_epoll1_linux.cc ... epoll_wait error: Bad file descriptor"; grpc/grpc#43055).
Interleaf never uses gRPC in a forked child, so it needs none of what the handlers do.
The setting is read when gRPC initialises, and children inherit it with the environment.
"""

from __future__ import annotations

import os

VARIABLE = "GRPC_ENABLE_FORK_SUPPORT"


def turn_off_grpc_fork_handlers() -> None:
    """Unless the user chose otherwise: their setting is kept."""
    os.environ.setdefault(VARIABLE, "false")
