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
- NCCL matches point-to-point messages by order, not by tag: the step program's
  lowering keeps every pair of ranks' sends and receives in one order
  (coordinator/schedule). The tag is accepted and unused.
- NCCL has no timeout: a watchdog (watchdog.py) aborts the communicator when an
  operation overruns. abort() and destroy() are called explicitly, never left to
  garbage collection, and two ranks on one GPU are refused, as NCCL does.
"""

from __future__ import annotations

import torch

from stageserver.transport.nccl_dtypes import nccl_type
from stageserver.transport.watchdog import Watchdog


def _nccl():
    try:
        from cupy.cuda import nccl
    except ImportError as err:
        raise RuntimeError("transport nccl needs CuPy with NCCL (pip install 'interleaf[gpu]', or 'interleaf[gpu-cuda13]'): "
                           f"{err}") from None
    return nccl


def make_unique_id() -> bytes:
    """ncclGetUniqueId: 128 bytes that every member passes to the communicator's init."""
    return bytes(_nccl().get_unique_id())


class NcclWork:
    def __init__(self, done: torch.cuda.Event, device: torch.device):
        self.done, self.device = done, device

    def wait(self) -> bool:
        """Orders the caller's stream after the operation; the host does not block."""
        torch.cuda.current_stream(self.device).wait_event(self.done)
        return True

    def is_completed(self) -> bool:
        return self.done.query()


class NcclTransport:
    def __init__(self, name: str, unique_id: bytes, rank: int, size: int, device: torch.device,
                 timeout_s: float):
        nccl = _nccl()
        import cupy

        self.name, self.rank, self.size, self.device = name, rank, size, device
        self._nccl = nccl
        with cupy.cuda.Device(device.index):
            # Blocks until every member has called it with the same id.
            self._comm = nccl.NcclCommunicator(size, bytes(unique_id), rank)
        self.stream = torch.cuda.Stream(device)
        self.watchdog = Watchdog(name, timeout_s, self._abort)
        self._closed = False

    # -- issuing -----------------------------------------------------------------------

    def _issue(self, what: str, tensors: list[torch.Tensor], body) -> NcclWork:
        self.watchdog.check()
        for t in tensors:
            if not t.is_cuda or not t.is_contiguous():
                raise ValueError(f"group {self.name}: {what} needs contiguous CUDA tensors")
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.device(self.device):
            body(self.stream.cuda_stream)
        for t in tensors:
            t.record_stream(self.stream)
        done = torch.cuda.Event()
        done.record(self.stream)
        return self.watchdog.watch(NcclWork(done, self.device), what)

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

        def body(stream):
            nccl.groupStart()
            try:
                for t, peer, _ in sends:
                    comm.send(t.data_ptr(), t.numel(), nccl_type(t.dtype), peer, stream)
                for t, peer, _ in recvs:
                    comm.recv(t.data_ptr(), t.numel(), nccl_type(t.dtype), peer, stream)
            finally:
                nccl.groupEnd()
        what = " ".join([f"send>{p}" for _, p, _ in sends] + [f"recv<{p}" for _, p, _ in recvs])
        return self._issue(what, [t for t, _, _ in (*sends, *recvs)], body)

    # -- collectives -------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False):
        nccl, comm = self._nccl, self._comm
        work = self._issue("all_reduce", [tensor], lambda s: comm.allReduce(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor.dtype), nccl.NCCL_SUM, s))
        return self._finish(work, async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        if output.numel() != tensor.numel() * self.size:
            raise ValueError(f"all_gather of {tensor.numel()} elements into {output.numel()} "
                             f"over {self.size} ranks")
        comm = self._comm
        work = self._issue("all_gather", [output, tensor], lambda s: comm.allGather(
            tensor.data_ptr(), output.data_ptr(), tensor.numel(), nccl_type(tensor.dtype), s))
        return self._finish(work, async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False):
        if tensor.numel() != output.numel() * self.size:
            raise ValueError(f"reduce_scatter of {tensor.numel()} elements into {output.numel()} "
                             f"over {self.size} ranks")
        nccl, comm = self._nccl, self._comm
        work = self._issue("reduce_scatter", [output, tensor], lambda s: comm.reduceScatter(
            tensor.data_ptr(), output.data_ptr(), output.numel(), nccl_type(tensor.dtype), nccl.NCCL_SUM, s))
        return self._finish(work, async_op)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        comm = self._comm
        self._issue("broadcast", [tensor], lambda s: comm.broadcast(
            tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), nccl_type(tensor.dtype), root, s)).wait()

    # -- teardown ----------------------------------------------------------------------

    def check(self) -> None:
        """Raises if the watchdog aborted this group."""
        self.watchdog.check()

    def _abort(self) -> None:
        if not self._closed:
            self._closed = True
            self._comm.abort()

    def close(self) -> None:
        self.watchdog.close()
        if not self._closed:
            self._closed = True
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
            self.stream.synchronize()
            self._comm.destroy()
