"""The verbs every transport offers; ranks are ranks within the group."""

from __future__ import annotations

from typing import Protocol

import torch


class Work(Protocol):
    def wait(self) -> object: ...


class Transport(Protocol):
    """A communication group. Collectives are in place and sum (ZeRO and DP average by
    pre-scaling), and every member must call them in the same order."""

    name: str
    rank: int
    size: int

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Starts sending; the tensor must not change until the work completes."""

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> Work:
        """Starts receiving into `tensor`; messages are matched by (peer, tag)."""

    def exchange(self, sends: list[tuple[torch.Tensor, int, int]],
                 recvs: list[tuple[torch.Tensor, int, int]]) -> Work:
        """Posts the sends and receives of one program tick, each (tensor, peer, tag), as
        one batch and returns one Work for them all: `groupStart/groupEnd` on NCCL,
        every operation posted before any is waited on gloo (`batch_isend_irecv`'s
        semantics). Under rendezvous semantics a rank that must both send to and
        receive from its neighbours at one tick deadlocks if it does so one at a time."""

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> Work | None: ...

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        """Concatenates every member's `tensor` along dim 0 into `output`."""

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> Work | None:
        """Sums `tensor` over members; member r keeps slice r (along dim 0) in `output`.
        Only `output` (1/size of `tensor`) is written: no full-size result exists."""

    def broadcast(self, tensor: torch.Tensor, root: int) -> None: ...

    def check(self) -> None:
        """Raises if the group has failed behind the caller's back (NCCL: an operation its
        watchdog aborted); the executor asks at the end of every step."""

    def close(self) -> None: ...
