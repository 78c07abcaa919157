"""How the simulator's point-to-point actions complete: the two link semantics.

- "rendezvous" (the default, and what the coordinator's programs are checked under):
  NCCL's semantics on one stream, and gloo's TCP pairs'. Every operation a rank posts
  completes only once its partner has been posted too, and the rank waits for the whole
  action (a plain send or receive, or an exchange's batch) before going on, as an
  executor that waits each batch at once does. So a send blocks its rank until the
  receiver reaches the matching receive, and two ranks that each send before they
  receive from the other deadlock. An exchange's members complete independently, as
  in an NCCL group: one whose partner is posted does not wait for its siblings'
  partners, but the rank waits for all of them.
- "eager": sends are buffered without limit and never block; a receive waits until its
  message has landed. The model the programs were first written for; it hides the
  deadlocks above, and is kept to compare timings.

Both charge each message latency + bytes/bandwidth, counted from when both of its ends
are posted (rendezvous) or from the send (eager); an exchange's messages travel together.
Messages are matched by (message_key, source rank, destination rank).
"""

from __future__ import annotations

from interleaf.protos.actions import SENDS, Action, Kind

LINKS = ("rendezvous", "eager")

Link = tuple[tuple, int, int]


def link_of(rank: int, op: Action) -> Link:
    """The message a send or receive on `rank` moves, the same at both ends."""
    if op.kind in SENDS:
        return op.message_key(), rank, op.peer
    return op.message_key(), op.peer, rank


def partner_of(rank: int, op: Action) -> Action:
    """The operation on `op.peer` that moves the same message as `op` on `rank`."""
    kind, consumer, microbatch = op.message_key()
    if op.kind in SENDS:
        return Action(Kind.RECV_ACT if kind == "act" else Kind.RECV_GRAD, consumer, microbatch, rank)
    producer = consumer - 1 if kind == "act" else consumer + 1
    return Action(Kind.SEND_ACT if kind == "act" else Kind.SEND_GRAD, producer, microbatch, rank)


class RendezvousLinks:
    def __init__(self, transfer_s: float):
        self.transfer_s = transfer_s
        self.posted: dict[tuple[Link, bool], float] = {}  # (link, is send) -> time posted

    def complete(self, rank: int, action: Action, start: float) -> float | None:
        """When `action`, reached by `rank` at `start`, completes; None while a partner
        is not posted. Posts the action's operations on the first call."""
        ops = action.p2p_ops()
        for op in ops:
            self.posted.setdefault((link_of(rank, op), op.kind in SENDS), start)
        partners = [self.posted.get((link_of(rank, op), op.kind not in SENDS)) for op in ops]
        if None in partners:
            return None
        return max(start, *partners) + self.transfer_s

    def waiting_for(self, rank: int, action: Action) -> list[Action]:
        """The operations of `action` whose partner has not been posted."""
        return [op for op in action.p2p_ops()
                if (link_of(rank, op), op.kind not in SENDS) not in self.posted]


class EagerLinks:
    def __init__(self, transfer_s: float):
        self.transfer_s = transfer_s
        self.landed: dict[Link, float] = {}  # message -> arrival time

    def complete(self, rank: int, action: Action, start: float) -> float | None:
        end = start
        for op in action.p2p_ops():
            if op.kind in SENDS:
                self.landed[link_of(rank, op)] = start + self.transfer_s
        for op in action.p2p_ops():
            if op.kind not in SENDS:
                arrival = self.landed.get(link_of(rank, op))
                if arrival is None:
                    return None
                end = max(end, arrival)
        return end

    def waiting_for(self, rank: int, action: Action) -> list[Action]:
        return [op for op in action.p2p_ops()
                if op.kind not in SENDS and link_of(rank, op) not in self.landed]


def make_links(links: str, transfer_s: float) -> RendezvousLinks | EagerLinks:
    if links not in LINKS:
        raise ValueError(f"links={links!r} must be one of {', '.join(LINKS)}")
    return RendezvousLinks(transfer_s) if links == "rendezvous" else EagerLinks(transfer_s)
