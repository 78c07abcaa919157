"""Runs all ranks' programs together against a cost model: step time, bubble, deadlock.

Compute and reductions occupy their rank, and so does posting a send, receive or
exchange where `measured` gives it a time (a replay's, or the planner's posting law);
sends, receives and exchanges complete as the link semantics say (`links.py`:
"rendezvous" by default, a send completing only when its peer reaches the matching
receive, or "eager", sends buffered without limit); the tie reduction completes when
both of its ranks have reached it. A parameter gather runs
in the background: the compute that first needs the chunk starts when it has landed,
and the rank's step ends when its last gather has.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from interleaf.protos.actions import COMPUTE, REDUCTIONS, WEIGHT_GRADS, Action, Kind

from .links import make_links, partner_of


@dataclass(frozen=True)
class CostModel:
    forward_s: float = 1.0
    """Seconds for one chunk's forward on one microbatch."""
    backward_s: float = 2.0
    """Seconds for one chunk's backward on one microbatch."""
    input_s: float | None = None
    """Seconds for its input-gradient half (I); None: half of backward_s."""
    weight_s: float | None = None
    """Seconds for its weight-gradient half (W); None: half of backward_s."""
    latency_s: float = 0.0
    """Seconds from a send until the first byte lands."""
    bandwidth_bytes_per_s: float = math.inf
    """Link bandwidth for point-to-point messages."""
    message_bytes: int = 0
    """Size of one activation or gradient message."""
    reduce_s: float = 0.0
    """Seconds for one REDUCE_GRADS or REDUCE_SCATTER_GRADS, or for REDUCE_TIED_GRADS
    once both ranks are in."""
    gather_s: float = 0.0
    """Seconds from issuing a GATHER_PARAMS until the chunk's parameters are there; the
    rank goes on meanwhile, and a compute that needs them waits for the rest."""
    optimizer_s: float = 0.0
    """Seconds for the optimizer step."""

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s", "input_s", "weight_s", "latency_s", "message_bytes",
                     "reduce_s", "gather_s", "optimizer_s"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"CostModel.{name}={getattr(self, name)} must be >= 0")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"CostModel.bandwidth_bytes_per_s="
                             f"{self.bandwidth_bytes_per_s} must be > 0")

    def transfer_s(self) -> float:
        return self.latency_s + self.message_bytes / self.bandwidth_bytes_per_s

    def compute_s(self, kind: Kind) -> float:
        """Seconds for one forward, backward or backward half."""
        if kind is Kind.FORWARD:
            return self.forward_s
        if kind is Kind.BACKWARD_INPUT:
            return self.backward_s / 2 if self.input_s is None else self.input_s
        if kind is Kind.BACKWARD_WEIGHT:
            return self.backward_s / 2 if self.weight_s is None else self.weight_s
        return self.backward_s


class Span(NamedTuple):
    """One action's time on its rank; for a receive, the time spent posting it and then
    waiting for its message."""
    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    makespan_s: float
    """Time from the first action until the last rank finishes."""
    busy_s: list[float]
    """Per rank, seconds spent computing: forwards, backwards and the weight update (the
    actions a stage server's idle time leaves out, so that the two bubbles compare),
    the input- and weight-gradient halves of split backwards included."""
    timeline: list[list[Span]]
    """Per rank, every action with its start and end, in program order."""

    @property
    def bubble_fraction(self) -> float:
        """Share of the ranks' time not spent computing: 1 - busy / (ranks * makespan)."""
        if self.makespan_s == 0:
            return 0.0
        return 1.0 - sum(self.busy_s) / (len(self.busy_s) * self.makespan_s)


class Blocked(NamedTuple):
    """A rank stuck at an action, and the operations of it whose partner never came."""
    rank: int
    index: int
    action: Action
    waiting_for: list[Action]

    def __str__(self) -> str:
        text = f"rank {self.rank} waits at action {self.index} ({self.action})"
        if self.waiting_for:
            text += " for " + ", ".join(f"{partner_of(self.rank, op)} on rank {op.peer}"
                                        for op in self.waiting_for)
        return text


class DeadlockError(ValueError):
    """No rank can make progress, yet some have not finished; `blocked` says where."""

    def __init__(self, blocked: list[Blocked]):
        self.blocked = blocked
        super().__init__("deadlock: " + "; ".join(str(b) for b in blocked))


def simulate(programs: list[list[Action]], cost: CostModel = CostModel(),
             links: str = "rendezvous", measured: list[list[float | None]] | None = None) -> SimResult:
    """Runs every rank until it blocks, repeating until all are done or none can move.

    `measured` replays an executed step: per rank, per action of its program, the
    seconds its compute took, in place of the cost model's forward, backward and
    optimizer costs, and for a send, receive or exchange the seconds the rank spent
    posting it, before its messages leave or its wait begins (None: nothing measured,
    the cost model's cost, which for posting is none).

    This computes the same times as a global event queue would: an action's start
    depends only on its own rank's previous action and on when the partners it waits
    for (the other ends of its messages, the tie partner) were posted or sent, never on
    the interleaving in which ranks are stepped here.
    """
    pp = len(programs)
    # The ranks holding the tied embedding's copies are those whose programs sum them
    # (placement.tie_ranks: one rank where the first and last chunk share it).
    tie_group = [r for r, program in enumerate(programs)
                 if any(a.kind is Kind.REDUCE_TIED_GRADS for a in program)]
    clock = [0.0] * pp
    position = [0] * pp
    timeline: list[list[Span]] = [[] for _ in range(pp)]
    link = make_links(links, cost.transfer_s())
    tie_arrivals: list[list[float]] = [[] for _ in range(pp)]
    ties_done = [0] * pp
    gathers: list[dict[int, float]] = [{} for _ in range(pp)]  # chunk -> landing time

    def step(rank: int) -> bool:
        """Runs `rank`'s next action if it can start now; says whether it did."""
        action = programs[rank][position[rank]]
        start = clock[rank]
        own = measured[rank][position[rank]] if measured is not None else None
        if action.kind in COMPUTE:
            start = max(start, gathers[rank].get(action.chunk, start))
            if own is None:
                own = cost.compute_s(action.kind)
            end = start + own
        elif action.kind is Kind.GATHER_PARAMS:
            gathers[rank][action.chunk] = start + cost.gather_s
            end = start
        elif action.kind is Kind.RELEASE_PARAMS:
            gathers[rank].pop(action.chunk, None)
            end = start
        elif action.p2p_ops():
            end = link.complete(rank, action, start + (own or 0.0))
            if end is None:
                return False
        elif action.kind is Kind.REDUCE_TIED_GRADS:
            end = _tie_end(rank, start, tie_group, tie_arrivals, ties_done[rank],
                           cost.reduce_s)
            if end is None:
                return False
            ties_done[rank] += 1
        elif action.kind in REDUCTIONS:
            # Every DP replica runs this same program, so the collective's members reach
            # it together and it costs the same as a local step.
            end = start + cost.reduce_s
        else:
            end = start + (cost.optimizer_s if own is None else own)
        timeline[rank].append(Span(action, start, end))
        clock[rank] = end
        position[rank] += 1
        return True

    progressed = True
    while progressed:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(programs[rank]) and step(rank):
                progressed = True
    for rank in range(pp):
        clock[rank] = max([clock[rank], *gathers[rank].values()])
    blocked = [r for r in range(pp) if position[r] < len(programs[r])]
    if blocked:
        raise DeadlockError([
            Blocked(r, position[r], programs[r][position[r]],
                    link.waiting_for(r, programs[r][position[r]]))
            for r in blocked])
    busy = [sum(s.end - s.start for s in spans
                if s.action.kind in COMPUTE or s.action.kind is Kind.OPTIMIZER_STEP)
            for spans in timeline]
    return SimResult(max(clock, default=0.0), busy, timeline)


def _tie_end(rank: int, start: float, group: list[int], arrivals: list[list[float]],
             done: int, reduce_s: float) -> float | None:
    """When this rank's next tie reduction (its `done`-th) ends, or None while a partner
    has not reached it yet. The rank's arrival is recorded on its first try only. (Which
    ranks belong to the group is the validator's check, against the placement.)"""
    if len(arrivals[rank]) == done:
        arrivals[rank].append(start)
    if any(len(arrivals[r]) <= done for r in group):
        return None
    return max(arrivals[r][done] for r in group) + reduce_s


def peak_activations(program: list[Action]) -> int:
    """The most (chunk, microbatch) pairs whose forward has run and whose backward (B,
    or the weight-gradient half W, which keeps part of them alive) has not: how many
    microbatches' activations the rank must hold at once."""
    in_flight = peak = 0
    for action in program:
        if action.kind is Kind.FORWARD:
            in_flight += 1
            peak = max(peak, in_flight)
        elif action.kind in WEIGHT_GRADS:
            in_flight -= 1
    return peak
