"""The CPU transport: one torch ProcessGroupGloo per group, built directly on a store
(no torch.distributed globals), so one process can hold many groups and many jobs."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from stageserver.transport.solo import SoloTransport


class GlooTransport:
    def __init__(self, name: str, group: dist.ProcessGroupGloo, rank: int, size: int):
        self.name = name
        self.rank = rank
        self.size = size
        self._group = group

    def send(self, tensor: torch.Tensor, peer: int, tag: int):
        return self._group.send([tensor], peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int):
        return self._group.recv([tensor], peer, tag)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        return _maybe_wait(self._group.allreduce([tensor]), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        # Gloo stages the gathered result in a full-size buffer of its own before copying
        # it out (measured: +output bytes of resident memory per call), a transient the
        # memory ledger does not see; NCCL writes in place.
        return _maybe_wait(self._group._allgather_base(output, tensor), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        # The list form: gloo's flat _reduce_scatter_base stages a full-size copy of the
        # input (measured: +input bytes per call), the list form at most one output's worth.
        if tensor.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter of {tensor.numel()} elements into {output.numel()} "
                             f"over {self.size} ranks")
        work = self._group.reduce_scatter([output], [list(tensor.chunk(self.size))], dist.ReduceScatterOptions())
        return _maybe_wait(work, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = root
        self._group.broadcast([tensor], opts).wait()

    def close(self) -> None:
        self._group.shutdown()


def _maybe_wait(work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


def connect_gloo(
    store: dist.Store,
    name: str,
    members: list[int],
    global_rank: int,
    timeout_s: float,
    hostname: str = "",
):
    """Joins the group `name` made of global ranks `members` (in group-rank order).

    Every member must call this; construction blocks until all have connected. A group
    of one needs no process group at all.
    """
    rank = members.index(global_rank)
    if len(members) == 1:
        return SoloTransport(name)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout_s)
    options._devices = [
        dist.ProcessGroupGloo.create_device(hostname=hostname)
        if hostname
        else dist.ProcessGroupGloo.create_default_device()
    ]
    group = dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, len(members), options)
    return GlooTransport(name, group, rank, len(members))
