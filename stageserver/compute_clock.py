"""When a step computes: each compute's start and end, in seconds from the step's start.

On a CPU the host's clock around each compute is the compute. On a GPU the host only
queues kernels, so its clock would measure launches: there every time is a CUDA event
recorded on the compute stream, which the GPU passes when it gets there, and the events
are read once, at the step's end, when the step has synchronized anyway (no
synchronization per action). Time between computes is what the step's idle time, its
measured bubble, counts; on a GPU that is time the compute stream had no compute in it.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch


class ComputeClock:
    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._origin = None
        self._last = None
        self._computes: list[tuple] = []

    def start_step(self) -> None:
        self._computes.clear()
        self._origin = self.mark()

    def mark(self):
        """Now, on the compute's timeline: the host clock, or on a GPU an event recorded on
        the compute stream (the current stream, whatever this thread's device)."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        self._last = event
        return event

    @contextmanager
    def measure(self):
        start = self.mark()
        yield
        self._computes.append((start, self.mark()))

    def seconds(self, marks: list) -> list[float]:
        """Marks of this step as seconds from its start (on a GPU, waits for the last
        event recorded: at the step's end, the GPU is already there)."""
        if not self.cuda:
            return [m - self._origin for m in marks]
        if self._last is not None:
            self._last.synchronize()
        return [self._origin.elapsed_time(m) / 1000 for m in marks]

    def computes(self) -> list[tuple[float, float]]:
        """The step's computes so far, in order, as (start, end) seconds from its start;
        they never overlap (one thread on a CPU, one stream on a GPU)."""
        flat = self.seconds([m for pair in self._computes for m in pair])
        return list(zip(flat[0::2], flat[1::2]))
