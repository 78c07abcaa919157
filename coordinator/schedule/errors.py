"""The error a program check raises, naming where in which rank's program."""

from __future__ import annotations

from interleaf.protos.actions import Action


class ProgramError(ValueError):
    def __init__(self, rank: int, index: int | None, action: Action | None, reason: str):
        self.rank, self.index, self.action = rank, index, action
        where = f"rank {rank}" if index is None else f"rank {rank}, action {index} ({action})"
        super().__init__(f"{where}: {reason}")
