"""Making and joining a job's communication groups, whichever the transport.

Each group's member 0 makes the group's id during Setup; the coordinator relays every
id to every member, and Connect joins the groups with them (job.py). For NCCL the id is
ncclGetUniqueId's 128 bytes, which the communicators rendezvous on; for gloo it is a
random suffix of the group's keys in the coordinator's store, so a group formed again
(a retried setup, a recovery) never reads a stale key of an earlier one. Both take the
same path through the coordinator, so the CPU tests exercise the relay that NCCL needs.
"""

from __future__ import annotations

import datetime
import os

import torch

from interleaf.stageserver.transport.base import Transport
from interleaf.stageserver.transport.gloo import connect_gloo
from interleaf.stageserver.transport.solo import SoloTransport

TRANSPORTS = ("gloo", "nccl")


def make_group_id(transport: str) -> bytes:
    if transport == "nccl":
        from interleaf.stageserver.transport.nccl import make_unique_id
        return make_unique_id()
    return os.urandom(16)


def connect_group(transport: str, name: str, group_id: bytes, members: list[int], global_rank: int, *,
                  store, timeout_s: float, hostname: str = "",
                  device: torch.device = torch.device("cpu")) -> Transport:
    """Joins group `name` (global ranks `members`, in group-rank order); blocks until
    every member has joined. A group of one needs no communicator."""
    if len(members) == 1:
        return SoloTransport(name)
    if not group_id:
        raise RuntimeError(f"group {name}: no id was relayed for it")
    if transport == "nccl":
        from interleaf.stageserver.transport.nccl import NcclTransport
        # NCCL's init has no timeout: meet every member on the store first, which does,
        # so a member that never comes fails this Connect instead of hanging it.
        keys = [f"nccl/{name}/{group_id.hex()}/{member}" for member in members]
        store.set(keys[members.index(global_rank)], b"1")
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
        return NcclTransport(name, group_id, members.index(global_rank), len(members), device, timeout_s)
    return connect_gloo(store, f"{name}/{group_id.hex()}", members, global_rank, timeout_s, hostname)
