"""The single-process peer: Interleaf's own reference loop (clients/reference.py) -
the whole model in one process, the same microbatches accumulated, the same optimizer -
run on a one-process peer_world so it too has exactly one torch thread."""

from __future__ import annotations

from interleaf.clients.reference import train as reference_train
from interleaf.coordinator.config import JobConfig


def train(rank: int, config: JobConfig) -> dict:
    history, _ = reference_train(config)
    return {"step_seconds": [r.step_seconds for r in history], "losses": [r.loss for r in history]}
