"""A job's traced steps (trace.steps): every rank's StepReport with its action spans, kept
with the job for `interleaf trace` (GetTrace), each with the plan it ran under (an
elastic job may be planned anew between two traced steps). Each is written through to
the job store as it is added, so a restarted coordinator still serves it.

At most trace.steps' steps are kept (64), so a job's traces stay small: one step of
pp=4, vpp=2, 16 microbatches is about 200 spans per rank. The torch profiles and memory
snapshots (trace.torch_profiler, trace.memory_snapshot) are not: each rank's may be MiBs,
so GetTrace leaves them out of the trace and serves them one rank at a time
(TraceRequest.profile_rank), and one over wire.MAX_PROFILE_BYTES is dropped with a note
(StepTrace.profile_notes) rather than making a reply too large for gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.plan import JobPlan
from interleaf.protos import interleaf_pb2 as pb
from interleaf.common.wire import MAX_PROFILE_BYTES


def traced_in_block(config: JobConfig, first: int, count: int) -> list[int]:
    """The steps of a RunSteps block [first, first+count) that the servers trace."""
    return sorted(s for s in config.trace.resolved(config.train.steps) if first <= s < first + count)


def trace_plan(job_id: str, config: JobConfig, plan: JobPlan) -> pb.StepTrace:
    """What a trace carries besides its reports: the programs and the layout."""
    p = config.parallel
    return pb.StepTrace(
        job_id=job_id,
        programs=[pb.PipelineProgram(pipeline_rank=r, actions=[pb.Action(text=str(a)) for a in program])
                  for r, program in enumerate(plan.programs)],
        ranks=plan.rank_infos(),
        grid=pb.Coordinates(dp=plan.grid.dp, pp=plan.grid.pp, tp=plan.grid.tp),
        schedule=p.schedule, vpp=p.vpp, microbatches=p.microbatches, zero=p.zero,
    )


class Traces:
    def __init__(self, stored: Iterable[pb.StepTrace] = (), persist: Callable[[pb.StepTrace], None] | None = None,
                 profiled: tuple[bool, bool] = (False, False), max_profile_bytes: int = MAX_PROFILE_BYTES):
        """`stored`: the job's traces a previous coordinator kept; `persist` writes each
        new one through to the job store; `profiled`: whether the job asks for torch
        profiles and memory snapshots (trace.torch_profiler, trace.memory_snapshot), whose
        absence from a rank's report is then noted."""
        self._lock = threading.Lock()
        self._profiled, self._max_profile_bytes = profiled, max_profile_bytes
        self._steps: dict[int, pb.StepTrace] = {}
        self._profiles: dict[tuple[int, int], pb.StepReport] = {}  # (step, rank) -> its report, whole
        for trace in stored:
            self._keep(trace)
        self._persist = persist

    def add(self, plan: pb.StepTrace, reports: list[pb.StepReport]) -> None:
        """Keeps a traced step (a step run again after a recovery replaces the earlier run)."""
        trace = pb.StepTrace()
        trace.CopyFrom(plan)
        trace.step = reports[0].step
        trace.reports.extend(sorted(reports, key=lambda r: r.rank))
        trace.profile_notes.extend(self._bound_profiles(trace))
        if self._persist is not None:  # whole, profiles included: a restarted coordinator serves them too
            self._persist(trace)
        self._keep(trace)

    def _bound_profiles(self, trace: pb.StepTrace) -> list[str]:
        """Drops each profile over the bound (a server that did not hold to it); notes
        each rank asked for one that has none."""
        notes = []
        for report in trace.reports:
            for field, what, asked in (("torch_profile", "torch profile", self._profiled[0]),
                                       ("memory_snapshot", "memory snapshot", self._profiled[1])):
                size = len(getattr(report, field))
                if size > self._max_profile_bytes:
                    report.ClearField(field)
                    notes.append(f"rank {report.rank}: its {what} of {size} bytes (gzip) is over the "
                                 f"{self._max_profile_bytes} a trace keeps: dropped")
                elif asked and not size:
                    notes.append(f"rank {report.rank}: no {what}: its server drops one over "
                                 f"{self._max_profile_bytes} bytes gzip-compressed (its log names the size)")
        return notes

    def _keep(self, trace: pb.StepTrace) -> None:
        """The trace kept without its profiles, which are kept (and served) one rank at a time."""
        kept = pb.StepTrace()
        kept.CopyFrom(trace)
        profiles, ranks = {}, []
        for whole, report in zip(trace.reports, kept.reports):
            if report.torch_profile or report.memory_snapshot:
                profiles[(trace.step, report.rank)] = whole
                ranks.append(report.rank)
                report.ClearField("torch_profile")
                report.ClearField("memory_snapshot")
        kept.ClearField("profiled_ranks")
        kept.profiled_ranks.extend(ranks)
        with self._lock:
            self._steps[trace.step] = kept
            for key in [k for k in self._profiles if k[0] == trace.step]:  # a step run again
                del self._profiles[key]
            self._profiles.update(profiles)

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def get(self, step: int | None = None) -> pb.StepTrace | None:
        """The traced step (None: the newest), with every step traced so far, its reports
        without their profiles (profiled_ranks names those kept: `profile`); None when
        that step was not traced (yet)."""
        with self._lock:
            if step is None:
                step = max(self._steps, default=None)
            found = self._steps.get(step)
            if found is None:
                return None
            trace = pb.StepTrace()
            trace.CopyFrom(found)
            trace.traced_steps.extend(sorted(self._steps))
            return trace

    def profile(self, step: int | None, rank: int) -> pb.StepTrace | None:
        """One rank's report of a traced step (None: the newest), whole: its torch profile
        and memory snapshot with it; the trace's other fields are left out. None when the
        step was not traced or that rank kept no profile."""
        with self._lock:
            if step is None:
                step = max(self._steps, default=None)
            report = self._profiles.get((step, rank))
            if report is None:
                return None
            return pb.StepTrace(job_id=self._steps[step].job_id, step=step, reports=[report])
