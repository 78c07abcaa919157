"""A traced step (Coordinator.GetTrace) as a Chrome/Perfetto trace, as a picture with the
simulator's prediction beside it, and as a summary: what `interleaf trace` writes and
the status page draws.

The measured bubble is the executed timeline's idle time: over all ranks, the part of
their step time in which they ran no compute (forward, backward or its input- and
weight-gradient halves I and W, weight update), sum(idle_seconds) / sum(step_seconds).
The prediction simulates the same programs with the forward and backward (or I and W)
costs of each chunk, and the update's and each kind of posting's on each stage,
measured in the same step (means over its microbatches and ranks), and messages that
travel in no time: what the schedule alone would leave idle.
Ranks are lined up by when each began the step (StepReport.started_unix).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

from interleaf.coordinator.schedule import CostModel, SimResult, simulate
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.actions import CATEGORIES, COMPUTE, REDUCTION, Action, Kind, parse

PREDICTION_LINKS = "eager"
"""The link semantics of the prediction. The executor never waits for a send (it is
reaped later), which eager links model; rendezvous links make each send wait for its
receiver, which the programs are checked under for deadlock but which the executor on
gloo does not do. Eager links wait for a receive where the program posts it, the
executor only where its consumer needs it: where a receive is posted ahead of its
consumer (coordinator/schedule/fuse.py) and its message is late, the simulator idles
the rank at the receive while the executor computed on, so it can predict more idle
time than the executor had, never less."""


@dataclass(frozen=True)
class Costs:
    forward_s: float
    backward_s: float
    update_s: float
    input_s: float | None = None
    """A backward's input-gradient half I; None where the step ran no split backward."""
    weight_s: float | None = None
    """Its weight-gradient half W; None likewise."""


def programs(trace: pb.StepTrace) -> list[list[Action]]:
    """The step's programs, by pipeline rank."""
    ordered = sorted(trace.programs, key=lambda p: p.pipeline_rank)
    return [[parse(a.text) for a in p.actions] for p in ordered]


def offsets(trace: pb.StepTrace) -> list[float]:
    """Per report, seconds from the earliest rank's step start to its own."""
    first = min(r.started_unix for r in trace.reports)
    return [r.started_unix - first for r in trace.reports]


def measured_bubble(trace: pb.StepTrace) -> float:
    total = sum(r.step_seconds for r in trace.reports)
    return sum(r.idle_seconds for r in trace.reports) / total if total else 0.0


def _measured_text(trace: pb.StepTrace) -> str:
    idle, total = sum(r.idle_seconds for r in trace.reports), sum(r.step_seconds for r in trace.reports)
    return f"bubble {measured_bubble(trace):.3f} (idle {idle:.3f} s of {total:.3f} rank-seconds)"


def measured_costs(trace: pb.StepTrace) -> Costs:
    """Mean seconds of one chunk's forward, backward (0 where every backward was split),
    its halves I and W (None where none was) and of the update, over every rank."""
    def mean(kind: str) -> float | None:
        return _mean([s.end_seconds - s.start_seconds for r in trace.reports for s in r.spans if s.kind == kind])

    return Costs(mean("forward") or 0.0, mean("backward") or 0.0, mean("update") or 0.0,
                 mean("input-grad"), mean("weight-grad"))


def predicted(trace: pb.StepTrace) -> tuple[SimResult, Costs]:
    """The simulator's prediction from the step's measured costs: each chunk's forward and
    backward (or each half, I and W) take that chunk's mean over the step's microbatches (and over the stage's
    data- and tensor-parallel ranks), the update its stage's mean, and posting a send, a
    receive or an exchange the stage's mean for that kind; the messages travel in no
    time. Per chunk, because chunks differ (the first holds the embedding, the last the
    head and the loss). Also returns the overall compute means, for the titles."""
    taken: dict[tuple, list[float]] = {}
    coords = _coords(trace)
    for report in trace.reports:
        for s in report.spans:
            if s.kind in _COSTED_KINDS:
                taken.setdefault(_cost_key(parse(s.action), coords[report.rank].pp), []).append(
                    s.end_seconds - s.start_seconds)
    steps = programs(trace)
    measured = [[_mean(taken.get(_cost_key(a, rank))) for a in program] for rank, program in enumerate(steps)]
    return simulate(steps, CostModel(), links=PREDICTION_LINKS, measured=measured), measured_costs(trace)


def _cost_key(action: Action, stage: int) -> tuple:
    """What a cost is averaged over in the prediction: a forward, backward, I or W with
    every other of its kind and chunk, the update and posting with the others of that
    kind on the stage (a span's kind is its action's category)."""
    kind = CATEGORIES.get(action.kind)
    if action.kind in COMPUTE:
        return kind, action.chunk
    return kind, "stage", stage


def replayed(trace: pb.StepTrace) -> SimResult:
    """The simulator replaying the step: every action takes what its rank spent in it
    (per pipeline rank, the mean over that stage's data- and tensor-parallel ranks):
    each compute its compute, each send, receive and exchange the executor's work
    posting it; the messages themselves travel in no time, and every wait for another
    rank is the simulator's. What the step's bubble would have been from the schedule
    and the ranks' own work alone: the executed bubble beyond it is the transfers, the
    collectives (data-parallel and tied-embedding all-reduces, ZeRO's reduce-scatters
    and gathers, which cost nothing here), the executor's work between actions (reading
    samples included) and time the ranks were not scheduled."""
    return replay_by_latency(trace)(0.0)


def replay_by_latency(trace: pb.StepTrace) -> Callable[[float], SimResult]:
    """The replay (replayed) with the messages travelling in a given latency, as a
    function of it, the step's programs and times read once: the planner seeks the
    latency at which the replay takes what the step took (plan_profile.message_latency)."""
    coords, taken = _coords(trace), {}
    for report in trace.reports:
        stage = taken.setdefault(coords[report.rank].pp, {})
        for s in report.spans:
            if s.kind in _COSTED_KINDS:
                stage.setdefault(s.action, []).append(s.end_seconds - s.start_seconds)
    steps = programs(trace)
    measured = [[_mean(taken[r].get(str(a))) for a in program] for r, program in enumerate(steps)]
    return lambda latency_s: simulate(steps, CostModel(latency_s=latency_s), links=PREDICTION_LINKS,
                                      measured=measured)


_COMPUTE_KINDS = ("forward", "backward", "input-grad", "weight-grad", "update")
POSTING_KINDS = ("send", "recv", "exchange")
"""Point-to-point actions, which the executor posts and never waits in (a receive is
waited by its consumer, a send reaped once the network has it): their spans are the
executor's own work. (On NCCL, a communicator's first point-to-point call also connects
to its peer and waits for it: a step traced first on a communicator, trace.steps=0 or
the first after an elastic re-plan, charges that wait as posting.)"""
_COSTED_KINDS = _COMPUTE_KINDS + POSTING_KINDS
"""The spans whose durations the prediction and the replay charge."""


def _mean(values: list[float] | None) -> float | None:
    return sum(values) / len(values) if values else None


def _coords(trace: pb.StepTrace) -> dict[int, pb.Coordinates]:
    return {info.rank: info.coordinates for info in trace.ranks}


def _args(action: Action, step: int) -> dict:
    if action.kind is Kind.EXCHANGE:
        return {"step": step, "members": [str(m) for m in action.members],
                "microbatches": sorted({m.microbatch for m in action.members})}
    args = {"step": step}
    if action.chunk >= 0:
        args["chunk"] = action.chunk
    if action.microbatch >= 0:
        args["microbatch"] = action.microbatch
    if action.peer >= 0:
        args["peer"] = action.peer
    return args


def chrome_trace(trace: pb.StepTrace) -> dict:
    """The Trace Event Format (Chrome's about:tracing, Perfetto): one process per rank with
    one thread holding its step's actions and a second its gradient buckets' reductions
    in flight (which overlap the backwards), a complete ("X") event per span, times in
    microseconds from the earliest rank's step start; the span's kind is the event's
    category."""
    coords, events = _coords(trace), []
    for report, offset in zip(trace.reports, offsets(trace)):
        c, rank = coords[report.rank], report.rank
        events += [
            {"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
             "args": {"name": f"rank {rank} (dp {c.dp}, pp {c.pp}, tp {c.tp})"}},
            {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": f"step {trace.step}"}},
            {"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "gradient reductions"}},
        ]
        for span in report.spans:
            events.append({
                "name": span.action, "cat": span.kind, "ph": "X", "pid": rank, "tid": int(span.kind == REDUCTION),
                "ts": (offset + span.start_seconds) * 1e6,
                "dur": (span.end_seconds - span.start_seconds) * 1e6,
                "args": _args(parse(span.action), trace.step),
            })
    result, costs = predicted(trace)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "job": trace.job_id, "step": trace.step, "schedule": trace.schedule,
            "grid": {"dp": trace.grid.dp, "pp": trace.grid.pp, "tp": trace.grid.tp}, "vpp": trace.vpp,
            "microbatches": trace.microbatches, "zero": trace.zero,
            "measured_bubble": measured_bubble(trace), "predicted_bubble": result.bubble_fraction,
            "replayed_bubble": replayed(trace).bubble_fraction,
            "idle_seconds": {str(r.rank): r.idle_seconds for r in trace.reports},
            "step_seconds": {str(r.rank): r.step_seconds for r in trace.reports},
            "measured_costs_seconds": vars(costs),
        },
    }


def write_chrome_trace(path: str, trace: pb.StepTrace) -> None:
    with open(path, "w") as f:
        json.dump(chrome_trace(trace), f)


def describe(trace: pb.StepTrace) -> str:
    g = trace.grid
    return (f"{trace.schedule}: dp={g.dp} pp={g.pp} tp={g.tp} vpp={trace.vpp}, {trace.microbatches} microbatches, "
            f"ZeRO stage {trace.zero}")


def _costs_text(costs: Costs) -> str:
    """The means the step measured: a backward's, its halves' where it was split (a
    program runs B or I and W; the text names what ran)."""
    backward = []
    if costs.backward_s or costs.input_s is None:
        backward.append(f"backward {costs.backward_s * 1e3:.1f} ms")
    if costs.input_s is not None:
        backward.append(f"input gradient {costs.input_s * 1e3:.1f} ms")
    if costs.weight_s is not None:
        backward.append(f"weight gradient {costs.weight_s * 1e3:.1f} ms")
    return (f"each chunk's measured costs: forward {costs.forward_s * 1e3:.1f} ms, {', '.join(backward)}, "
            f"update {costs.update_s * 1e3:.1f} ms on average")


def write_picture(path: str, trace: pb.StepTrace):
    """Writes `figure(trace)` as a PNG to `path`."""
    from interleaf.coordinator.schedule import picture  # imported here: only pictures need matplotlib

    return picture.save(path, figure(trace))


def figure(trace: pb.StepTrace):
    """The executed step above the simulator's prediction, on one time axis in ms."""
    from interleaf.coordinator.schedule import picture  # imported here: only pictures need matplotlib

    pp, coords = trace.grid.pp, _coords(trace)
    rows = []
    for report, offset in zip(trace.reports, offsets(trace)):
        c = coords[report.rank]
        bars = [picture.bar_of(parse(s.action), s.kind, (offset + s.start_seconds) * 1e3,
                               (offset + s.end_seconds) * 1e3, pp) for s in report.spans if s.kind != REDUCTION]
        rows.append((f"rank {report.rank} · dp{c.dp} pp{c.pp} tp{c.tp}", bars))
    executed = picture.Panel(f"executed: {_measured_text(trace)}", rows)
    result, costs = predicted(trace)
    ms = [[s._replace(start=s.start * 1e3, end=s.end * 1e3) for s in spans] for spans in result.timeline]
    prediction = picture.Panel(f"simulator's prediction ({_costs_text(costs)}): bubble {result.bubble_fraction:.3f}",
                               [(f"pipeline rank {r}", picture.sim_bars(spans, pp)) for r, spans in enumerate(ms)])
    return picture.figure([executed, prediction], "time (ms)",
                          f"{trace.job_id}, step {trace.step}: {describe(trace)}", shades=trace.vpp)


def summary(trace: pb.StepTrace) -> str:
    coords = _coords(trace)
    lines = [f"{trace.job_id} step {trace.step} (traced steps: {', '.join(map(str, trace.traced_steps))}): "
             f"{describe(trace)}",
             "rank  dp  pp  tp  step s    compute s  idle s    bubble"]
    for r in trace.reports:
        c = coords[r.rank]
        bubble = r.idle_seconds / r.step_seconds if r.step_seconds else 0.0
        lines.append(f"{r.rank:<5} {c.dp:<3} {c.pp:<3} {c.tp:<3} {r.step_seconds:<9.4f} {r.compute_seconds:<10.4f} "
                     f"{r.idle_seconds:<9.4f} {bubble:.3f}")
    result, costs = predicted(trace)
    lines.append(f"measured {_measured_text(trace)}")
    lines.append(f"predicted bubble {result.bubble_fraction:.3f} (the simulator, {_costs_text(costs)})")
    lines.append(f"replayed bubble {replayed(trace).bubble_fraction:.3f} (the simulator, each compute and each "
                 f"posting taking what it took in this step)")
    return "\n".join(lines)
