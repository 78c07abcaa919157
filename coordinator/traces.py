"""A job's traced steps (trace.steps): every rank's StepReport with its action spans, kept
with the job for `interleaf trace` (GetTrace), each with the plan it ran under (an
elastic job may be planned anew between two traced steps). Each is written through to
the job store as it is added, so a restarted coordinator still serves it.

At most trace.steps' steps are kept (64), so a job's traces stay small: one step of
pp=4, vpp=2, 16 microbatches is about 200 spans per rank.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.plan import JobPlan
from interleaf.protos import interleaf_pb2 as pb


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
    def __init__(self, stored: Iterable[pb.StepTrace] = (), persist: Callable[[pb.StepTrace], None] | None = None):
        """`stored`: the job's traces a previous coordinator kept; `persist` writes each
        new one through to the job store."""
        self._lock = threading.Lock()
        self._steps: dict[int, pb.StepTrace] = {trace.step: trace for trace in stored}
        self._persist = persist

    def add(self, plan: pb.StepTrace, reports: list[pb.StepReport]) -> None:
        """Keeps a traced step (a step run again after a recovery replaces the earlier run)."""
        trace = pb.StepTrace()
        trace.CopyFrom(plan)
        trace.step = reports[0].step
        trace.reports.extend(sorted(reports, key=lambda r: r.rank))
        with self._lock:
            self._steps[trace.step] = trace
        if self._persist is not None:
            self._persist(trace)

    def steps(self) -> list[int]:
        with self._lock:
            return sorted(self._steps)

    def get(self, step: int | None = None) -> pb.StepTrace | None:
        """The traced step (None: the newest), with every step traced so far; None when
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
