"""The step program's vocabulary: one small action per thing a rank does.

A program is a list of `Action`s per pipeline rank. Chunks are numbered globally
(0 .. pp*vpp-1). Which pipeline rank holds a chunk is the schedule's placement
(coordinator/schedule/placement.py): chunk c on rank c % pp for every schedule but
zbv, whose V puts chunks r and 2*pp-1-r on rank r. Peers are pipeline-group ranks.

Every action has a compact string form that round-trips through `parse`:

    F3.1        forward of chunk 3 on microbatch 1
    B3.1        backward of chunk 3 on microbatch 1 (input and weight gradients at once)
    I3.1        the input-gradient half of B3.1: the gradient of chunk 3's input (sent
                upstream at once) and every activation gradient inside the chunk
    W3.1        the weight-gradient half of B3.1, from what I3.1 left (each linear's
                input and output gradient); needed only by the optimizer step, so a
                zero-bubble schedule runs it wherever a rank would otherwise idle
    SA3.1>2     send chunk 3's output activation of microbatch 1 to pipeline rank 2
    RA4.1<1     receive chunk 4's input activation of microbatch 1 from pipeline rank 1
    SG4.1>1     send the gradient of chunk 4's input, microbatch 1, to pipeline rank 1
    RG3.1<2     receive the gradient of chunk 3's output, microbatch 1, from pipeline rank 2
    DP3         all-reduce chunk 3's gradients over the data-parallel group (ZeRO-0)
    RS3         reduce-scatter chunk 3's gradients: each data-parallel rank keeps the sum
                of its shard (ZeRO-1/2/3, once per chunk and step)
    AG3         all-gather chunk 3's parameters from the data-parallel shards (ZeRO-3
                before the chunk's compute; ZeRO-1/2 after the optimizer step)
    RP3         release chunk 3's gathered parameters (ZeRO-3)
    TIE         all-reduce the tied embedding's gradient (first and last stage)
    OPT         optimizer step
    SA0.1>1+RG0.0<1
                an exchange (kind X): the sends and receives a rank makes at one tick,
                posted as one batch (an NCCL group; on gloo, all posted before any is
                waited), as Megatron's send_forward_recv_backward; its members are two
                or more of the four point-to-point forms above, joined by "+"
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    SEND_ACT = "SA"
    RECV_ACT = "RA"
    SEND_GRAD = "SG"
    RECV_GRAD = "RG"
    REDUCE_GRADS = "DP"
    REDUCE_SCATTER_GRADS = "RS"
    GATHER_PARAMS = "AG"
    RELEASE_PARAMS = "RP"
    REDUCE_TIED_GRADS = "TIE"
    OPTIMIZER_STEP = "OPT"
    EXCHANGE = "X"

    # Members are singletons, equal only to themselves: hashed by identity they fill sets
    # and dicts as Enum's hash of the name does (whose order str hashing randomizes per
    # process anyway), at a fraction of its cost - the planner's search hashes millions.
    __hash__ = object.__hash__


COMPUTE = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT})
INPUT_GRADS = frozenset({Kind.BACKWARD, Kind.BACKWARD_INPUT})
"""Backwards that consume the chunk's output gradient and make its input gradient."""
WEIGHT_GRADS = frozenset({Kind.BACKWARD, Kind.BACKWARD_WEIGHT})
"""Backwards that write the chunk's parameter gradients (and end its microbatch's
activations)."""
READS_PARAMS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.BACKWARD_INPUT})
"""Computes that read the chunk's parameters (a ZeRO-3 chunk must be gathered for
them). A weight-gradient pass reads only saved activations and output gradients."""
SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
P2P = SENDS | RECVS
PER_CHUNK = frozenset({Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS, Kind.GATHER_PARAMS,
                       Kind.RELEASE_PARAMS})
REDUCTIONS = frozenset({Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS})

CATEGORIES = {
    Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.OPTIMIZER_STEP: "update",
    Kind.BACKWARD_INPUT: "input-grad", Kind.BACKWARD_WEIGHT: "weight-grad",
    Kind.SEND_ACT: "send", Kind.SEND_GRAD: "send", Kind.RECV_ACT: "recv", Kind.RECV_GRAD: "recv",
    Kind.EXCHANGE: "exchange", Kind.REDUCE_GRADS: "collective", Kind.REDUCE_TIED_GRADS: "collective",
    Kind.REDUCE_SCATTER_GRADS: "zero", Kind.GATHER_PARAMS: "zero", Kind.RELEASE_PARAMS: "zero",
}
"""What each kind of action is, as traces and timeline pictures tell them apart: compute
(forward, backward or its input- and weight-gradient halves, the weight update),
point-to-point (send, recv, exchange), the data-parallel and tied-embedding all-reduces (collective), and ZeRO's reduce-scatters,
gathers and releases (zero)."""

REDUCTION = "reduction"
"""A traced span's kind that is no action's: a gradient bucket's data-parallel reduction
in flight, from its start (inside a backward, under parallel.overlap_grad_reduce) until
its rank saw it done. The DP or RS action that started the chunk's reductions has its
own span; the trace's prediction, replay and picture leave these out."""


@dataclass(frozen=True, order=True)
class Action:
    kind: Kind
    chunk: int = -1
    microbatch: int = -1
    peer: int = -1
    members: tuple[Action, ...] = ()
    """An exchange's point-to-point operations, in the order they are posted."""

    def __post_init__(self) -> None:
        if self.kind is Kind.EXCHANGE:
            if len(self.members) < 2 or any(m.kind not in P2P for m in self.members):
                raise ValueError("an exchange holds two or more sends and receives, got "
                                 f"{[str(m) for m in self.members]}")
            if len(set(self.members)) != len(self.members):
                raise ValueError(f"an exchange posts each operation once: {self}")
        elif self.members:
            raise ValueError(f"only an exchange has members, not {self.kind.name}")

    def p2p_ops(self) -> tuple[Action, ...]:
        """The sends and receives this action posts: an exchange's members, a send or
        receive itself, nothing for any other kind."""
        if self.kind is Kind.EXCHANGE:
            return self.members
        return (self,) if self.kind in P2P else ()

    def __str__(self) -> str:
        k = self.kind.value
        if self.kind is Kind.EXCHANGE:
            return "+".join(str(m) for m in self.members)
        if self.kind in COMPUTE:
            return f"{k}{self.chunk}.{self.microbatch}"
        if self.kind in SENDS:
            return f"{k}{self.chunk}.{self.microbatch}>{self.peer}"
        if self.kind in RECVS:
            return f"{k}{self.chunk}.{self.microbatch}<{self.peer}"
        if self.kind in PER_CHUNK:
            return f"{k}{self.chunk}"
        return k

    def message_key(self) -> tuple[str, int, int]:
        """Identifies the tensor a send or receive moves, the same on both ends.

        A send of chunk c's activation and the receive of chunk c+1's input carry one
        tensor; both map to ("act", c+1, m). Gradients map to ("grad", c-1, m): the
        chunk that consumes them.
        """
        if self.kind is Kind.SEND_ACT:
            return ("act", self.chunk + 1, self.microbatch)
        if self.kind is Kind.RECV_ACT:
            return ("act", self.chunk, self.microbatch)
        if self.kind is Kind.SEND_GRAD:
            return ("grad", self.chunk - 1, self.microbatch)
        if self.kind is Kind.RECV_GRAD:
            return ("grad", self.chunk, self.microbatch)
        raise ValueError(f"{self} moves no tensor")


_PATTERN = re.compile(r"^(SA|RA|SG|RG|DP|RS|AG|RP|TIE|OPT|F|B|I|W)(\d+)?(?:\.(\d+))?(?:[<>](\d+))?$")


def parse(text: str) -> Action:
    """Inverse of `str(action)`."""
    if "+" in text:
        return Action(Kind.EXCHANGE, members=tuple(parse(part) for part in text.strip().split("+")))
    match = _PATTERN.match(text.strip())
    if not match:
        raise ValueError(f"not an action: {text!r}")
    code, chunk, microbatch, peer = match.groups()
    action = Action(
        Kind(code),
        int(chunk) if chunk is not None else -1,
        int(microbatch) if microbatch is not None else -1,
        int(peer) if peer is not None else -1,
    )
    if str(action) != text.strip():
        raise ValueError(f"malformed action {text!r} (did you mean {action}?)")
    return action


def splits_backward(program: list[Action]) -> bool:
    """Whether a program splits its backwards into I and W (the zero-bubble schedules):
    what a stage server reads to decide whether its blocks may compile
    (common/model/compile_modes.py)."""
    return any(a.kind is Kind.BACKWARD_INPUT for a in program)


def format_program(actions: list[Action]) -> str:
    return " ".join(str(a) for a in actions)


def parse_program(text: str) -> list[Action]:
    return [parse(token) for token in text.split()]
