"""Seconds a step spends computing.

On a CPU the host's clock around each compute is the compute. On a GPU the host only
queues kernels, so its clock would measure launches: there each compute is bracketed by
CUDA events, read once at the step's end when the step has synchronized anyway.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class ComputeClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0

    @contextmanager
    def measure(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)  # the compute's, whatever this thread's device
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self._seconds += time.perf_counter() - t0

    def take(self) -> float:
        """The seconds measured since the last take (waits for the GPU's events)."""
        if self._events:
            self._events[-1][1].synchronize()
            self._seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1000
            self._events.clear()
        seconds, self._seconds = self._seconds, 0.0
        return seconds
