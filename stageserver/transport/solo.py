"""A group of one: every collective is the identity. The single-process reference and
any group of size 1 (tp=1, dp=1) use it, so model code never special-cases sizes."""

from __future__ import annotations

import torch


class _Done:
    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class SoloTransport:
    size = 1
    rank = 0

    def __init__(self, name: str = "solo"):
        self.name = name

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        raise RuntimeError(f"group {self.name} has one member: nothing to send to {peer}")

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> _Done:
        raise RuntimeError(f"group {self.name} has one member: nothing to receive from {peer}")

    def exchange(self, sends, recvs) -> _Done:
        if sends or recvs:
            raise RuntimeError(f"group {self.name} has one member: no point-to-point partner")
        return _Done()

    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False) -> _Done | None:
        return _Done() if async_op else None

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> _Done | None:
        output.copy_(tensor)
        return _Done() if async_op else None

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = False) -> _Done | None:
        output.copy_(tensor)
        return _Done() if async_op else None

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        return None

    def check(self) -> None:
        return None  # failures surface in the operations themselves

    def close(self) -> None:
        return None
