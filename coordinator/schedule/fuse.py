"""Pass 2b of lowering: moves every send and receive to its message's tick and fuses
what a rank posts at one tick into one exchange, so that no program can deadlock under
rendezvous semantics (`links.py`: a send completes only when its peer reaches the
matching receive, as with NCCL on one stream and gloo's TCP pairs).

`add_p2p` puts each receive right before its consumer and each send right after its
producer. Under rendezvous semantics that deadlocks as soon as two neighbours each
send before they receive: 1F1B, pp=2, m=4, rank 0 runs "F0.1 SA0.1>1 RG0.0<1 B0.0"
while rank 1 runs "B1.0 SG1.0>0 RA1.1<0 F1.1", and each send waits for a receive the
other rank reaches only after its own send.

The placement. Split each rank's compute order into steps: one forward or backward,
or (interleaved 1F1B's steady state, `pair_steady_state`) a forward with the backward
after it. Run all ranks' steps on a tick clock (a forward lasts 1 tick, a backward 2),
each as soon as its rank is free and the steps making its inputs have ended. A
message's tick is when the step making it ends, and both of its ends go there: the
send right behind that step, the receive at the same point of the receiving rank's
program, i.e. after its steps that start earlier and before those that start then or
later. So a receive is posted *ahead* of its consumer, as soon as the tensor exists,
whenever the receiving rank has other work before the consumer (1F1B, pp=2: rank 1
posts RA1.1 before B1.0, then runs F1.1): the sender is released at once, not after
the receiver's intervening compute, and the receiver's group for the tick also
carries what it sends at that tick. Everything a rank posts at one tick becomes one
EXCHANGE: the send of what it just made with the receives of what its neighbours just
made, Megatron's `send_forward_recv_backward` and `send_backward_recv_forward` (and,
for a pair, `send_forward_backward_recv_forward_backward`). A tick with a single
operation keeps the plain action.

Why no program so placed can deadlock, whatever the real compute and link times:
give every send, receive and exchange the tick it sits at. On each rank they appear in
increasing tick order, one action per tick, and both ends of a message share a tick.
Suppose everything at ticks before t has completed on every rank. Each rank then
reaches its action at tick t, because what lies before it are actions at earlier ticks
and computes whose inputs were received before them, at earlier ticks. So every
operation at tick t finds its partner posted, and all of tick t completes; by
induction, the whole step. The tick lengths only choose among safe placements:
with these, ranks meet without waiting when a backward costs about two forwards.
(`validate_programs` checks the result by simulation all the same.)

Example, 1F1B pp=2 m=4:
    rank 0: F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 F0.2 SA0.2>1+RG0.1<1 B0.1 ...
    rank 1: RA1.0<0 F1.0 RA1.1<0 B1.0 SG1.0>0 F1.1 B1.1 SG1.1>0+RA1.2<0 F1.2 ...
"""

from __future__ import annotations

from dataclasses import dataclass, field

from interleaf.protos.actions import COMPUTE, RECVS, SENDS, Action, Kind

from .links import Link, link_of

# Any tick lengths give deadlock-free programs (see above). A backward does about twice
# a forward's FLOPs; placed for that ratio, the programs lose no time to rendezvous
# waits against eager links, with free links and a backward costing 1 to 3 forwards,
# in every layout up to pp=8 but interleaved pp=5, which loses under 3%
# (tests/test_rendezvous.py).
_FORWARD_TICKS, _BACKWARD_TICKS = 1, 2
# The zero-bubble orders were made on a clock where F, I and W take one tick each
# (zero_bubble.py); placed on the same clock, their messages meet as planned.
_TICKS = {Kind.FORWARD: _FORWARD_TICKS, Kind.BACKWARD: _BACKWARD_TICKS,
          Kind.BACKWARD_INPUT: 1, Kind.BACKWARD_WEIGHT: 1}


@dataclass
class _Step:
    """Computes a rank runs with no point-to-point action between them: one forward or
    backward, or a steady-state pair."""
    computes: list[Action] = field(default_factory=list)
    receives: list[Action] = field(default_factory=list)  # what the computes consume
    sends: list[Action] = field(default_factory=list)  # what they produce
    start: int = 0


def place_p2p(programs: list[list[Action]], pair_steady_state: bool = False) -> list[list[Action]]:
    """Rewrites `add_p2p`'s programs (computes, each receive right before its consumer
    and each send right after its producer) with every send and receive at its
    message's tick, fused per rank and tick.

    `pair_steady_state` (interleaved 1F1B): after a rank's first backward, a forward
    and the backward right after it are one step, so the rank communicates once per
    pair, sending both outputs and receiving both inputs together, as Megatron's
    interleaved schedule does (`send_forward_backward_recv_forward_backward`). Every
    rank's pair then lasts as long, so neighbours meet without waiting even when a
    backward costs more than a forward; plain 1F1B needs no pairing for that, and
    pairing it would delay each activation by a backward that its short warmup
    cannot hide.
    """
    steps = [_steps(rank, program, pair_steady_state) for rank, program in enumerate(programs)]
    ticks = _run_ticks(steps)
    return [_place(rank, rank_steps, ticks) for rank, rank_steps in enumerate(steps)]


def _steps(rank: int, program: list[Action], pair: bool) -> list[_Step]:
    steps: list[_Step] = []
    receives: list[Action] = []
    backward_seen = False
    for action in program:
        if action.kind in RECVS:
            receives.append(action)
        elif action.kind in SENDS:
            steps[-1].sends.append(action)
        elif action.kind in COMPUTE:
            previous = steps[-1].computes if steps else []
            if (pair and backward_seen and action.kind is Kind.BACKWARD
                    and [a.kind for a in previous] == [Kind.FORWARD]):
                steps[-1].computes.append(action)
                steps[-1].receives += receives
            else:
                steps.append(_Step([action], receives))
            backward_seen |= action.kind is Kind.BACKWARD
            receives = []
        else:
            raise ValueError(f"place_p2p expects add_p2p's programs; rank {rank} has {action}")
    return steps


def _run_ticks(steps: list[list[_Step]]) -> dict[Link, int]:
    """Runs all ranks' steps as soon as their rank is free and their inputs are made;
    returns each message's tick (when its producing step ends) and sets each step's
    start."""
    made: dict[Link, int] = {}
    position, free = [0] * len(steps), [0] * len(steps)
    progressed = True
    while progressed:
        progressed = False
        for rank, rank_steps in enumerate(steps):
            while position[rank] < len(rank_steps):
                step = rank_steps[position[rank]]
                inputs = [made.get(link_of(rank, op)) for op in step.receives]
                if None in inputs:
                    break
                step.start = max([free[rank], *inputs])
                free[rank] = step.start + sum(_TICKS[a.kind] for a in step.computes)
                made.update((link_of(rank, op), free[rank]) for op in step.sends)
                position[rank] += 1
                progressed = True
    stuck = [r for r, rank_steps in enumerate(steps) if position[r] < len(rank_steps)]
    if stuck:
        raise ValueError(f"ranks {stuck} wait on each other: the compute order (or its "
                         f"pairing) is cyclic")
    return made


def _place(rank: int, steps: list[_Step], ticks: dict[Link, int]) -> list[Action]:
    at_tick: dict[int, list[Action]] = {}
    for step in steps:
        for op in step.sends + step.receives:
            at_tick.setdefault(ticks[link_of(rank, op)], []).append(op)
    pending = sorted(at_tick)
    placed: list[Action] = []
    for step in steps:
        while pending and pending[0] <= step.start:
            placed.append(_fused(at_tick[pending.pop(0)]))
        placed += step.computes
    return placed + [_fused(at_tick[t]) for t in pending]


def _fused(ops: list[Action]) -> Action:
    """One tick's operations: sends first (what the rank just produced), then receives."""
    ordered = [op for op in ops if op.kind in SENDS] + [op for op in ops if op.kind in RECVS]
    return ordered[0] if len(ordered) == 1 else Action(Kind.EXCHANGE, members=tuple(ordered))
