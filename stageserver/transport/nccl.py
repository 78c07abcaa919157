"""The GPU transport: one NCCL communicator per group, through CuPy
(`cupy.cuda.nccl.NcclCommunicator`, CuPy >= 14).

- Tensors are torch CUDA tensors passed by data pointer with their NCCL type
  (nccl_dtypes.py; bf16 has no NumPy type for CuPy to infer).
- Each group runs its operations on a stream of its own, as torch's ProcessGroupNCCL
  does: the stream first waits for the work already queued on the caller's stream (the
  tensor is ready), and `Work.wait()` makes the caller's stream wait for the operation's
  end event. Neither blocks the host, so the executor queues compute and communication
  without synchronizing. Each tensor is marked as used on the group's stream
  (`record_stream`), so the caching allocator does not hand its memory to another
  tensor while NCCL may still read or write it.
- NCCL matches point-to-point messages by order, not by tag: the coordinator's
  validator checks that every pair of ranks posts its sends and receives in one order
  (coordinator/schedule/validate.py). The tag is accepted and unused.
- NCCL has no timeout: a watchdog (watchdog.py) aborts the communicator when an
  operation overruns, counting from when the operation's turn on the stream came, not
  from when the host queued it. Issuing and aborting hold one lock, so an abort never
  frees the communicator under a call being made with it (unless that call itself is
  stuck inside NCCL past a grace period: then the abort is the only way out).
  abort() and destroy() are called explicitly, never left to garbage collection; a
  close() that finds operations still running after a grace period aborts instead of
  destroying, so a dead peer cannot hang the server's teardown.
- Two ranks on one GPU: NCCL refuses them, and the coordinator refuses such a placement
  before any server is set up (coordinator/plan.py).
"""

from __future__ import annotations

import threading
import time

import torch

from interleaf.stageserver.transport.nccl_dtypes import nccl_type
from interleaf.stageserver.transport.watchdog import Watchdog

CLOSE_GRACE_S = 10.0
"""How long close() waits for operations still running before it aborts."""
ABORT_LOCK_S = 5.0
"""How long an abort waits for a call in progress to leave NCCL before aborting anyway."""


def nccl_module():
    """cupy.cuda.nccl, or a clear error naming what to install."""
    try:
        from cupy.cuda import nccl
    except ImportError as err:
        raise RuntimeError("transport nccl needs CuPy with NCCL (pip install 'interleaf[gpu]', or "
                           f"'interleaf[gpu-cuda13]'): {err}") from None
    return nccl


def make_unique_id() -> bytes:
    """ncclGetUniqueId: 128 bytes that every member passes to the communicator's init."""
    return bytes(nccl_module().get_unique_id())


class NcclWork:
    def __init__(self, started: torch.cuda.Event, done: torch.cuda.Event, device: torch.device):
        self.started, self.done, self.device = started, done, device

    def wait(self) -> bool:
        """Orders the caller's stream after the operation; the host does not block."""
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return True

    # Queried from the watchdog's thread, whose current device may be another GPU.
    def is_started(self) -> bool:
        with torch.cuda.device(self.device):
            return self.started.query()

    def is_completed(self) -> bool:
        with torch.cuda.device(self.device):
            return self.done.query()


class NcclTransport:
    def __init__(self, name: str, unique_id: bytes, rank: int, size: int, device: torch.device,
                 timeout_s: float):
        nccl = nccl_module()
        import cupy

        self.name, self.rank, self.size, self.device = name, rank, size, device
        self._nccl = nccl
        with cupy.cuda.Device(device.index):
            # Blocks until every member has called it with the same id.
            self._comm = nccl.NcclCommunicator(size, bytes(unique_id), rank)
        self.stream = torch.cuda.Stream(device)
        self._lock = threading.Lock()
        self._closed = False
        self.watchdog = Watchdog(name, timeout_s, self._abort)

    # -- issuing -----------------------------------------------------------------------

    def _issue(self, what: str, tensors: list[torch.Tensor], body) -> NcclWork:
        for t in tensors:
            if not t.is_cuda or not t.is_contiguous():
                raise ValueError(f"group {self.name}: {what} needs contiguous CUDA tensors, got one of "
                                 f"shape {tuple(t.shape)} on {t.device} with strides {t.stride()}")
        with self._lock:
            self.watchdog.check()
            if self._closed:
                raise RuntimeError(f"group {self.name} is closed")
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            started, done = torch.cuda.Event(), torch.cuda.Event()
            with torch.cuda.device(self.device):
                started.record(self.stream)
                body(self.stream.cuda_stream)
                done.record(self.stream)
        for t in tensors:
            t.record_stream(self.stream)
        return self.watchdog.watch(NcclWork(started, done, self.device), what)

    @staticmethod
    def _finish(work: NcclWork, async_op: bool):
        if async_op:
            return work
        work.wait()
        return None

    # -- point to point ----------------------------------------------------------------

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> NcclWork:
        return self.exchange([(tensor, peer, tag)], [])

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> NcclWork:
        return self.exchange([], [(tensor, peer, tag)])

    def exchange(self, sends, recvs) -> NcclWork:
        nccl, comm = self._nccl, self._comm
        # Types first: an error between groupStart and groupEnd would launch half a group.
        sends = [(t, nccl_type(t.dtype), peer) for t, peer, _ in sends]
        recvs = [(t, nccl_type(t.dtype), peer) for t, peer, _ in recvs]

        def body(stream):
            nccl.groupStart()
            try:
                for t, kind, peer in sends:
                    comm.send(t.data_ptr(), t.numel(), kind, peer, stream)
                for t, kind, peer in recvs:
                    comm.recv(t.data_ptr(), t.numel(), kind, peer, stream)
            finally:
                nccl.groupEnd()
        what = " ".join([f"send>{p}" for _, _, p in sends] + [f"recv<{p}" for _, _, p in recvs])
        return self._issue(what, [t for t, _, _ in (*sends, *recvs)], body)

    # -- collectives -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        nccl, comm, kind = self._nccl, self._comm, nccl_type(tensor.dtype)
        work = self._issue("all_reduce", [tensor], lambda s: comm.allReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), kind, nccl.NCCL_SUM, s))
        return self._finish(work, async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        if output.numel() != tensor.numel() * self.size:
            raise ValueError(f"group {self.name}: all_gather of {tensor.numel()} elements into "
                             f"{output.numel()} over {self.size} ranks")
        comm, kind = self._comm, nccl_type(tensor.dtype)
        work = self._issue("all_gather", [output, tensor], lambda s: comm.allGather(
            tensor.data_ptr(), output.data_ptr(), tensor.numel(), kind, s))
        return self._finish(work, async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        if tensor.numel() != output.numel() * self.size:
            raise ValueError(f"group {self.name}: reduce_scatter of {tensor.numel()} elements into "
                             f"{output.numel()} over {self.size} ranks")
        nccl, comm, kind = self._nccl, self._comm, nccl_type(tensor.dtype)
        work = self._issue("reduce_scatter", [output, tensor], lambda s: comm.reduceScatter(
            tensor.data_ptr(), output.data_ptr(), output.numel(), kind, nccl.NCCL_SUM, s))
        return self._finish(work, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        comm, kind = self._comm, nccl_type(tensor.dtype)
        self._issue("broadcast", [tensor], lambda s: comm.broadcast(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), kind, root, s)).wait()

    # -- teardown ----------------------------------------------------------------------

    def check(self) -> None:
        """Raises if the watchdog aborted this group."""
        self.watchdog.check()

    def _abort(self) -> None:
        # A call stuck inside NCCL holds the lock: abort anyway after a grace period,
        # since aborting is what releases it.
        locked = self._lock.acquire(timeout=ABORT_LOCK_S)
        try:
            if not self._closed:
                self._closed = True
                self._comm.abort()
        finally:
            if locked:
                self._lock.release()

    def close(self) -> None:
        """Destroys the communicator once its operations have finished; aborts it if they
        have not within CLOSE_GRACE_S (a peer gone), so teardown never hangs."""
        deadline = time.monotonic() + CLOSE_GRACE_S
        while not self._closed and not self.stream.query() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._closed and not self.stream.query():
            self._abort()
        self.watchdog.close()
        with self._lock:
            if not self._closed:
                self._closed = True
                self._comm.destroy()
