"""The CPU transport: one torch ProcessGroupGloo per group, built directly on a store
(no torch.distributed globals), so one process can hold many groups and many jobs."""

from __future__ import annotations

import datetime
import queue
import threading

import torch
import torch.distributed as dist

from interleaf.stageserver.transport.solo import SoloTransport


class GlooTransport:
    def __init__(self, name: str, group: dist.ProcessGroupGloo, rank: int, size: int):
        self.name = name
        self.rank = rank
        self.size = size
        self._group = group
        self._sends = _SendReaper(name)

    def send(self, tensor: torch.Tensor, peer: int, tag: int):
        return self._sends.reap(self._group.send([tensor], peer, tag))

    def recv(self, tensor: torch.Tensor, peer: int, tag: int):
        return self._group.recv([tensor], peer, tag)

    def exchange(self, sends, recvs):
        # gloo's point-to-point is asynchronous per pair: posting every operation before
        # waiting on any is what torch's batch_isend_irecv does for gloo.
        works = [self.send(t, peer, tag) for t, peer, tag in sends]
        works += [self.recv(t, peer, tag) for t, peer, tag in recvs]
        return _AllOf(works)

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        return _maybe_wait(self._group.allreduce([tensor]), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        # One broadcast per member, each writing its slice of `output` in place. Gloo's
        # own allgather stages the whole result in a buffer of its own first (measured:
        # +output bytes of resident memory per call), which would cost ZeRO-3 a second
        # copy of every gathered chunk; on loopback the broadcasts were faster too
        # (24 MiB: 17 against 27 ms over 2 ranks, 45 against 72 ms over 4).
        if output.numel() != tensor.numel() * self.size:
            raise ValueError(f"all_gather of {tensor.numel()} elements into {output.numel()} "
                             f"over {self.size} ranks")
        slices = output.chunk(self.size)
        slices[self.rank].copy_(tensor)  # a no-op when `tensor` is that slice
        works = []
        for root, view in enumerate(slices):
            options = dist.BroadcastOptions()
            options.rootRank = root
            works.append(self._group.broadcast([view], options))
        return _maybe_wait(_AllOf(works), async_op)

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

    def check(self) -> None:
        return None  # failures surface in the operations themselves

    def abort(self) -> None:
        """Asks gloo to end the group now (a watchdog's last resort, as NCCL's
        ncclCommAbort). In torch 2.13 a gloo group's abort does nothing: operations in
        flight end at the group's timeout or when a peer's connection closes."""
        self._group.abort()

    def close(self) -> None:
        self._group.shutdown()
        self._sends.close()


class _AllOf:
    """Several works waited as one."""

    def __init__(self, works: list):
        self.works = works

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        return True

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


class _SendReaper:
    """Gloo's send works say they are complete only once waited (torch's SendWork has no
    isCompleted of its own), so a step could not tell a send the network has taken from
    one still going, and would hold every tensor it sent until its end. One thread per
    group waits each send, in posting order, and marks it done: `is_completed` then
    answers without blocking. Started with the group's first send."""

    def __init__(self, name: str):
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._waiting: _ReapedSend | None = None  # the send the thread is in gloo's wait for
        self._closed = False
        self._lock = threading.Lock()

    def reap(self, work) -> _ReapedSend:
        send = _ReapedSend(work)
        with self._lock:
            if self._closed:  # a step still running when its job was closed
                send.fail(self._closed_error())
                return send
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"gloo-sends-{self._name}", daemon=True)
                self._thread.start()
            self._queue.put(send)
        return send

    def _run(self) -> None:
        while (send := self._queue.get()) is not None:
            with self._lock:
                self._waiting = send
                if self._closed:  # closed since it was taken off the queue: close did not see it
                    send.fail(self._closed_error())
            try:
                send.work.wait()
            except Exception as err:  # the group failed: the sender's wait raises it
                send.fail(err)
            else:
                send.finish()
            finally:
                with self._lock:
                    self._waiting = None
            del send  # holds no sent tensor while waiting for the next

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"group {self._name} was closed before this send was taken")

    def close(self) -> None:
        """Fails every send not yet done, so that no step waits on a closed group, and
        ends the thread once gloo's wait for the send it holds returns. That wait, gloo
        cannot interrupt (its group's abort and shutdown do nothing), and a send whose
        receiver never posted its receive is not ended by the receiver's death either
        (measured: the wait outlived the peer's exit by the whole 5 s of a server's exit
        bound). So the sender is let go here and only the daemon thread waits on: for the
        receiver, or the group's timeout. The work keeps the sent tensor alive till then."""
        with self._lock:
            self._closed = True
            if self._waiting is not None:
                self._waiting.fail(self._closed_error())
            while True:
                try:
                    send = self._queue.get_nowait()
                except queue.Empty:
                    break
                send.fail(self._closed_error())
            if self._thread is not None:
                self._queue.put(None)


class _ReapedSend:
    """A send whose completion the group's reaper thread marks."""

    def __init__(self, work):
        self.work = work
        self.done = threading.Event()
        self.error: Exception | None = None
        self._ending = threading.Lock()  # the reaper and a closing group may end it at once

    def fail(self, error: Exception) -> None:
        """Ends the wait with `error`, unless it has already ended (the first word stands)."""
        with self._ending:
            if not self.done.is_set():
                self.error = error
                self.done.set()

    def finish(self) -> None:
        with self._ending:
            self.done.set()

    def wait(self) -> bool:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()


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
