"""trace.torch_profiler and trace.memory_snapshot: torch's own tools over a traced step.

A traced step (RunStepsRequest.trace_steps) already times every action (the executor's
ComputeClock); with these settings the server also runs, over that same step,
- torch.profiler (CPU operators; CUDA kernels too on a GPU) and exports its Chrome trace;
- torch.cuda.memory._record_memory_history, and takes torch.cuda.memory._snapshot() at
  the step's end (the allocator's every allocation and free in the step, with Python stacks;
  pytorch.org/memory_viz draws the pickle).
Both travel gzip-compressed in the step's report (StepReport.torch_profile,
.memory_snapshot) and are kept with the job's traced step: they outlive the job, as
`interleaf trace` is usually run after it, where a file in the server's spool would go
with the job's teardown. Chrome trace JSON compresses about tenfold. One over
wire.MAX_PROFILE_BYTES compressed is dropped (logged), so a report fits one message.

Only traced steps pay: the others run no profiler and record no history.
"""

from __future__ import annotations

import contextlib
import gzip
import logging
import os
import pickle
import tempfile
from dataclasses import dataclass

import torch

from interleaf.common.wire import MAX_PROFILE_BYTES

log = logging.getLogger("interleaf.stageserver")

MAX_HISTORY_ENTRIES = 100_000
"""Allocator events kept for a snapshot (torch's own default): a step of a large model
makes tens of thousands; the oldest beyond this are dropped, never the step's end."""


class ProfilingRejected(ValueError):
    """trace.memory_snapshot asked of a server with no CUDA device."""


@dataclass
class Profiles:
    """What a traced step's tools captured, gzip-compressed; empty when not asked for."""
    torch_profile: bytes = b""
    memory_snapshot: bytes = b""


class StepProfiler:
    def __init__(self, torch_profiler: bool, memory_snapshot: bool, device: torch.device):
        if memory_snapshot and device.type != "cuda":
            raise ProfilingRejected(f"memory_snapshot records CUDA memory history, and this server computes on "
                                    f"{device}")
        self.torch_profiler, self.memory_snapshot, self.device = torch_profiler, memory_snapshot, device

    @contextlib.contextmanager
    def over(self, traced: bool):
        """Profiles the step run inside when `traced`; yields the Profiles, filled at exit."""
        profiles = Profiles()
        if not traced or not (self.torch_profiler or self.memory_snapshot):
            yield profiles
            return
        if self.memory_snapshot:
            # Python stacks: they name the code that allocated (the model's, or inductor's
            # generated graph); torch's default adds C++ frames, which a snapshot must then
            # symbolize, for seconds to minutes on a large step, mostly naming the allocator.
            torch.cuda.memory._record_memory_history(max_entries=MAX_HISTORY_ENTRIES, stacks="python",
                                                     device=self.device)
        try:
            with self._profiler() as profiler:
                yield profiles
            if self.memory_snapshot:
                snapshot = torch.cuda.memory._snapshot(self.device)
                profiles.memory_snapshot = gzip.compress(pickle.dumps(snapshot), compresslevel=6)
        finally:
            if self.memory_snapshot:
                torch.cuda.memory._record_memory_history(enabled=None, device=self.device)
        if profiler is not None:
            profiles.torch_profile = _chrome_trace(profiler)
        profiles.torch_profile = within_bound(profiles.torch_profile, "torch profile")
        profiles.memory_snapshot = within_bound(profiles.memory_snapshot, "memory snapshot")

    def _profiler(self):
        if not self.torch_profiler:
            return contextlib.nullcontext()
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        return torch.profiler.profile(activities=activities, record_shapes=True)


def within_bound(data: bytes, what: str, most: int = MAX_PROFILE_BYTES) -> bytes:
    """`data`, or nothing when over `most`: a report must fit one gRPC message, and the
    step's trace is worth more than one rank's profile (the coordinator notes its absence
    in the trace, StepTrace.profile_notes)."""
    if len(data) <= most:
        return data
    log.warning("the traced step's %s is %d bytes gzip-compressed, over the %d a trace keeps: dropped (trace "
                "fewer steps' actions, or profile a smaller run)", what, len(data), most)
    return b""


def _chrome_trace(profiler) -> bytes:
    """The profiler's Chrome trace, gzip-compressed: torch exports to a file only."""
    fd, path = tempfile.mkstemp(prefix="interleaf-profile-", suffix=".json")
    os.close(fd)
    try:
        profiler.export_chrome_trace(path)
        with open(path, "rb") as f:
            return gzip.compress(f.read(), compresslevel=6)
    finally:
        os.unlink(path)
