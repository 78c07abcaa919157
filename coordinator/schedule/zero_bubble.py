"""Pass 1 for the zero-bubble schedules (Qi et al., "Zero Bubble Pipeline
Parallelism", ICLR 2024): per rank, the order of forwards (F), input-gradient
backwards (I) and weight-gradient backwards (W).

A backward splits into I, which the previous stage waits for, and W, which only the
optimizer step needs. Running every I as early as it can go and W later fills the
pipeline's bubbles with W: 1F1B idles (p-1)(F+B) of a step on every rank, ZB-H1
only (p-1)(F+I-W), and ZB-V's V placement (placement.py) turns the gradient around
on the last rank so that the bubble nearly vanishes when F, I and W cost alike.

ZB-H1 (`zb_h1_order`) is 1F1B with each B cut into I and W, rank r running its W
r microbatches late: the last rank, which 1F1B keeps waiting longest in the
cooldown, has the most W left to fill that wait with. Rank r then holds activations
for (p-r) + r = p microbatches at most (a W frees them), 1F1B's first-rank peak.

    zb-h1, pp=2, microbatches=4:
    rank 0: F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 F0.3 I0.2 W0.2 I0.3 W0.3
    rank 1: F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 F1.3 I1.3 W1.2 W1.3

ZB-V (`zero_bubble_orders`) comes from a greedy list scheduler run on a unit clock
(F, I and W one tick each, the paper's assumption): whenever a rank is free it
runs, in this order of preference,
  1. an I whose output gradient has arrived (the oldest microbatch first), since a
     rank upstream waits for it;
  2. an F whose input has arrived, if fewer than `limit` of its microbatch-chunks
     hold activations (their F has run and their W has not), the deepest chunk first
     so that gradients start coming back sooner;
  3. the oldest pending W;
and otherwise idles until something arrives. The limit bounds memory: 2*pp
microbatches of its half-size chunks, the bytes of 1F1B's first-rank peak.

    zbv, pp=2, microbatches=4 (chunks 0 and 3 on rank 0, 1 and 2 on rank 1):
    rank 0: F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I0.0 I3.1 W0.0 F0.3 I0.1 W3.1 F3.2 I3.2 W0.1
            W3.2 I0.2 W0.2 F3.3 I3.3 W3.3 I0.3 W0.3
    rank 1: F1.0 F2.0 F1.1 F2.1 I2.0 I1.0 W2.0 F1.2 I2.1 I1.1 W1.0 F2.2 W2.1 F1.3 I2.2 I1.2
            W1.1 F2.3 W2.2 W1.2 I2.3 I1.3 W2.3 W1.3

The orders are fixed data, whatever the real costs; `fuse.place_p2p` then places
their messages so that they cannot deadlock, and `simulate` replays them with
measured costs. With a backward costing two forwards, pp=4 and 8 microbatches, the
simulated bubble is 27% for 1F1B and 11% for ZB-H1, 16% for interleaved 1F1B
(vpp=2) and 6% for ZB-V.
"""

from __future__ import annotations

from collections import deque

from interleaf.protos.actions import Action, Kind

from .placement import chunks_on


def zb_h1_order(rank: int, pp: int, microbatches: int) -> list[Action]:
    """Rank `rank`'s ZB-H1 order: 1F1B's warmup of pp-rank-1 forwards, then F and I
    alternating with each W run `rank` microbatches after its I, then the remaining
    I each followed by a W, then the W still owed."""
    warmup = min(pp - rank - 1, microbatches)
    order = [Action(Kind.FORWARD, rank, k) for k in range(warmup)]
    owed: deque[Action] = deque()
    for k in range(microbatches):
        if warmup + k < microbatches:
            order.append(Action(Kind.FORWARD, rank, warmup + k))
        order.append(Action(Kind.BACKWARD_INPUT, rank, k))
        owed.append(Action(Kind.BACKWARD_WEIGHT, rank, k))
        if warmup + k >= microbatches or len(owed) > rank:
            order.append(owed.popleft())
    return order + list(owed)


def zero_bubble_orders(placement: tuple[int, ...], microbatches: int,
                       limits: list[int]) -> list[list[Action]]:
    """Per rank, its forwards, input- and weight-gradient backwards, for chunks placed
    by `placement` (chunk c on rank placement[c]); `limits[r]`: the most
    microbatch-chunks rank r holds activations for at once."""
    pp = max(placement) + 1
    last = len(placement) - 1
    if any(limit < 1 for limit in limits):
        raise ValueError(f"in-flight limits {limits} must be at least 1")
    owned = [chunks_on(placement, rank) for rank in range(pp)]
    ended: dict[Action, int] = {}  # compute -> the tick it ends
    next_forward = [0] * len(placement)  # per chunk: the next microbatch to run forward
    next_input = [0] * len(placement)  # and through its input-gradient backward
    pending_weight: list[deque[Action]] = [deque() for _ in range(pp)]
    in_flight = [0] * pp
    free = [0] * pp
    orders: list[list[Action]] = [[] for _ in range(pp)]
    total = 3 * microbatches * len(placement)

    def arrived(action: Action, now: int) -> bool:
        return ended.get(action, now + 1) <= now

    def pick(rank: int, now: int) -> Action | None:
        inputs = [Action(Kind.BACKWARD_INPUT, c, next_input[c]) for c in owned[rank]
                  if next_input[c] < next_forward[c]
                  and arrived(Action(Kind.FORWARD, c, next_input[c]), now)
                  and (c == last or arrived(Action(Kind.BACKWARD_INPUT, c + 1, next_input[c]), now))]
        if inputs:
            return min(inputs, key=lambda a: (a.microbatch, -a.chunk))
        if in_flight[rank] < limits[rank]:
            forwards = [Action(Kind.FORWARD, c, next_forward[c]) for c in reversed(owned[rank])
                        if next_forward[c] < microbatches
                        and (c == 0 or arrived(Action(Kind.FORWARD, c - 1, next_forward[c]), now))]
            if forwards:
                return forwards[0]
        # A pending W's I ran on this rank, which is free: it has ended.
        return pending_weight[rank][0] if pending_weight[rank] else None

    now = 0
    while len(ended) < total:
        started = False
        for rank in range(pp):
            if free[rank] > now:
                continue
            action = pick(rank, now)
            if action is None:
                continue
            started = True
            orders[rank].append(action)
            ended[action] = free[rank] = now + 1
            if action.kind is Kind.FORWARD:
                next_forward[action.chunk] += 1
                in_flight[rank] += 1
            elif action.kind is Kind.BACKWARD_INPUT:
                next_input[action.chunk] += 1
                pending_weight[rank].append(Action(Kind.BACKWARD_WEIGHT, action.chunk, action.microbatch))
            else:
                pending_weight[rank].popleft()
                in_flight[rank] -= 1
        # Every compute lasts one tick, so whatever can happen next happens at now + 1,
        # when what started now ends; if nothing started, nothing ever will.
        if not started:
            stuck = {r: in_flight[r] for r in range(pp) if len(orders[r]) < 3 * microbatches * len(owned[r])}
            raise ValueError(f"zero-bubble scheduling is stuck: ranks {sorted(stuck)} hold {stuck} microbatch-"
                             f"chunks at their limits {limits} and wait for gradients that cannot come")
        now += 1
    return orders
