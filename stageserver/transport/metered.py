"""Counts a rank's communication per (op, group): seconds blocked in it, bytes it moved,
calls. Every verb of a group passes through here, tensor-parallel collectives inside
forward and backward included, so the figures cover what the executor's own
`comm_wait_seconds` (its waits on receives, reductions and gathers) leaves out.

What is counted, per call:
- bytes: a send's or receive's tensor; an exchange's sends under `send` and its
  receives under `recv`; a collective's local buffer: all_reduce and broadcast the
  tensor, all_gather its full output, reduce_scatter its full input;
- seconds: the time the caller was held: the whole call when synchronous; for work
  returned to be waited later, only the time inside its `wait` (an exchange's wait
  counts under `recv` when it receives anything, else under `send`).

Two clock reads and a dict update per call: nothing a step would notice.
"""

from __future__ import annotations

import threading
import time

import torch

from interleaf.stageserver.transport.base import Transport


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CommMeter:
    """A rank's totals since the last `take`, shared by all of its groups."""

    def __init__(self):
        self._lock = threading.Lock()
        self._totals: dict[tuple[str, str], list] = {}

    def add(self, op: str, group: str, seconds: float = 0.0, nbytes: int = 0, calls: int = 0) -> None:
        with self._lock:
            total = self._totals.setdefault((op, group), [0.0, 0, 0])
            total[0] += seconds
            total[1] += nbytes
            total[2] += calls

    def take(self) -> list[tuple[str, str, float, int, int]]:
        """(op, group, seconds, bytes, calls) per pair since the last take, and starts over."""
        with self._lock:
            totals, self._totals = self._totals, {}
        return [(op, group, s, b, c) for (op, group), (s, b, c) in sorted(totals.items())]


class _TimedWork:
    """A work whose waits are counted as `op` blocked time."""

    def __init__(self, work, meter: CommMeter, op: str, group: str):
        self.work, self.meter, self.op, self.group = work, meter, op, group

    @torch.compiler.disable  # eager: inside a compiled block a collective is a custom operator (traced_collectives.py)
    def wait(self):
        t0 = time.perf_counter()
        try:
            return self.work.wait()
        finally:
            self.meter.add(self.op, self.group, seconds=time.perf_counter() - t0)

    def is_completed(self) -> bool:
        return self.work.is_completed()


class MeteredTransport:
    """The same verbs as the wrapped transport, counted under the group's role."""

    def __init__(self, inner: Transport, role: str, meter: CommMeter):
        self.inner, self.role, self.meter = inner, role, meter
        self.name, self.rank, self.size = inner.name, inner.rank, inner.size

    @torch.compiler.disable  # eager: inside a compiled block a collective is a custom operator (traced_collectives.py)
    def _posted(self, op: str, work, nbytes: int):
        self.meter.add(op, self.role, nbytes=nbytes, calls=1)
        return _TimedWork(work, self.meter, op, self.role)

    @torch.compiler.disable  # eager: inside a compiled block a collective is a custom operator (traced_collectives.py)
    def _collective(self, op: str, nbytes: int, run, async_op: bool):
        t0 = time.perf_counter()
        work = run()
        self.meter.add(op, self.role, seconds=time.perf_counter() - t0, nbytes=nbytes, calls=1)
        return _TimedWork(work, self.meter, op, self.role) if async_op else work

    def send(self, tensor: torch.Tensor, peer: int, tag: int):
        return self._posted("send", self.inner.send(tensor, peer, tag), _bytes(tensor))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int):
        return self._posted("recv", self.inner.recv(tensor, peer, tag), _bytes(tensor))

    @torch.compiler.disable  # eager: inside a compiled block a collective is a custom operator (traced_collectives.py)
    def exchange(self, sends, recvs):
        work = self.inner.exchange(sends, recvs)
        if sends:
            self.meter.add("send", self.role, nbytes=sum(_bytes(t) for t, _, _ in sends), calls=len(sends))
        if recvs:
            self.meter.add("recv", self.role, nbytes=sum(_bytes(t) for t, _, _ in recvs), calls=len(recvs))
        return _TimedWork(work, self.meter, "recv" if recvs else "send", self.role)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        return self._collective("all_reduce", _bytes(tensor), lambda: self.inner.all_reduce(tensor, async_op),
                                async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        return self._collective("all_gather", _bytes(output),
                                lambda: self.inner.all_gather(output, tensor, async_op), async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        return self._collective("reduce_scatter", _bytes(tensor),
                                lambda: self.inner.reduce_scatter(output, tensor, async_op), async_op)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        return self._collective("broadcast", _bytes(tensor), lambda: self.inner.broadcast(tensor, root), False)

    def check(self) -> None:
        return self.inner.check()

    def close(self) -> None:
        self.inner.close()


def metered(transport: Transport, role: str, meter: CommMeter) -> Transport:
    """`transport` counted in `meter`; a group of one moves nothing and is left as it is."""
    return transport if transport.size == 1 else MeteredTransport(transport, role, meter)
