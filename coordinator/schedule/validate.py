"""Static checks on lowered programs; `simulate` adds the dynamic one (deadlock).

Every failure names the rank, the action index and the action, because that is what
an engineer needs to find the bad pass, and what a stage server reports when a step
fails at run time.
"""

from __future__ import annotations

from protos.actions import COMPUTE, PER_CHUNK, RECVS, SENDS, Action, Kind
from .errors import ProgramError
from .zero_rules import check_zero


def validate_programs(programs: list[list[Action]], pp: int, vpp: int,
                      microbatches: int, zero: int = 0) -> None:
    """Raises ProgramError on the first rule a program breaks:

    - every action's chunk lives on its rank, and every send/receive names the rank
      that owns the neighbouring chunk;
    - each (chunk, microbatch) has exactly one forward and one backward, forward first;
    - every send has exactly one matching receive on its peer and vice versa;
    - a receive comes before the compute that consumes it, a send after the one that
      produces it; a chunk's REDUCE_GRADS comes once, after all of its backwards;
    - REDUCE_TIED_GRADS is only on the first and last rank; OPTIMIZER_STEP appears once,
      last (under ZeRO-1/2 followed only by the gathers of the updated parameters);
    - the ZeRO rules of `zero_rules.check_zero` for the stage: the reductions and
      gathers it uses, no use of a parameter before its gather or after its release.
    """
    if len(programs) != pp:
        raise ValueError(f"got {len(programs)} programs for pp={pp}")
    for rank, program in enumerate(programs):
        _check_placement(program, rank, pp, vpp)
        _check_compute(program, rank, pp, vpp, microbatches)
        _check_ordering(program, rank, pp, vpp)
        check_zero(program, rank, pp, vpp, zero)
    _check_matching(programs)


def _check_placement(program: list[Action], rank: int, pp: int, vpp: int) -> None:
    for i, a in enumerate(program):
        if a.kind in COMPUTE or a.kind in SENDS or a.kind in RECVS or a.kind in PER_CHUNK:
            if not 0 <= a.chunk < pp * vpp or a.chunk % pp != rank:
                raise ProgramError(rank, i, a, f"chunk {a.chunk} does not live on rank "
                                               f"{rank} (chunk c lives on rank c % {pp})")
        if a.kind in SENDS or a.kind in RECVS:
            neighbour = a.message_key()[1] if a.kind in SENDS else _source_chunk(a)
            if a.peer != neighbour % pp:
                raise ProgramError(rank, i, a, f"peer should be rank {neighbour % pp}, "
                                               f"which holds chunk {neighbour}")
        if a.kind is Kind.REDUCE_TIED_GRADS and (pp * vpp == 1 or rank not in (0, pp - 1)):
            raise ProgramError(rank, i, a, "only the ranks of the first and last of several "
                                           "chunks hold a copy of the tied embedding")
        if a.kind is Kind.OPTIMIZER_STEP and any(b.kind is not Kind.GATHER_PARAMS
                                                 for b in program[i + 1:]):
            raise ProgramError(rank, i, a, "the optimizer step must be the last action "
                                           "(but for the gathers of the updated parameters)")
    if sum(a.kind is Kind.OPTIMIZER_STEP for a in program) != 1:
        raise ProgramError(rank, None, None, "program must have exactly one OPT")


def _source_chunk(recv: Action) -> int:
    """The chunk that produces what `recv` receives: the previous chunk's activation, or
    the next chunk's input gradient."""
    return recv.chunk - 1 if recv.kind is Kind.RECV_ACT else recv.chunk + 1


def _check_compute(program: list[Action], rank: int, pp: int, vpp: int,
                   microbatches: int) -> None:
    seen: dict[tuple[Kind, int, int], int] = {}
    for i, a in enumerate(program):
        if a.kind not in COMPUTE:
            continue
        key = (a.kind, a.chunk, a.microbatch)
        if key in seen:
            raise ProgramError(rank, i, a, f"repeats action {seen[key]}")
        if not 0 <= a.microbatch < microbatches:
            raise ProgramError(rank, i, a, f"microbatch outside 0..{microbatches - 1}")
        if a.kind is Kind.BACKWARD and (Kind.FORWARD, a.chunk, a.microbatch) not in seen:
            raise ProgramError(rank, i, a, f"backward before F{a.chunk}.{a.microbatch}")
        seen[key] = i
    for chunk in range(rank, pp * vpp, pp):
        for m in range(microbatches):
            for kind in (Kind.FORWARD, Kind.BACKWARD):
                if (kind, chunk, m) not in seen:
                    missing = Action(kind, chunk, m)
                    raise ProgramError(rank, None, None, f"program lacks {missing}")


def _check_ordering(program: list[Action], rank: int, pp: int, vpp: int) -> None:
    last = pp * vpp - 1
    index = {a: i for i, a in enumerate(program)}
    received = {a.message_key(): i for i, a in enumerate(program) if a.kind in RECVS}
    reduced: dict[int, int] = {}
    for i, a in enumerate(program):
        c, m = a.chunk, a.microbatch
        if a.kind is Kind.FORWARD and c > 0 and (c - 1) % pp != rank:
            needed = ("act", c, m)
        elif a.kind is Kind.BACKWARD and c < last and (c + 1) % pp != rank:
            needed = ("grad", c, m)
        elif a.kind in SENDS:
            producer = Action(Kind.FORWARD if a.kind is Kind.SEND_ACT else Kind.BACKWARD,
                              c, m)
            if index.get(producer, len(program)) > i:
                raise ProgramError(rank, i, a, f"sent before {producer} produces it")
            continue
        elif a.kind is Kind.REDUCE_GRADS:
            if c in reduced:
                raise ProgramError(rank, i, a, f"chunk {c} was reduced at action {reduced[c]}")
            reduced[c] = i
            backwards = [j for b, j in index.items()
                         if b.kind is Kind.BACKWARD and b.chunk == c]
            if max(backwards, default=-1) > i:
                raise ProgramError(rank, i, a, f"chunk {c} still has backwards to run "
                                               f"(action {max(backwards)})")
            continue
        else:
            continue
        if received.get(needed, len(program)) > i:
            what = "input activation" if needed[0] == "act" else "output gradient"
            raise ProgramError(rank, i, a, f"its {what} is not received before it")


def _check_matching(programs: list[list[Action]]) -> None:
    """Pairs every send with one receive by (message_key, source rank, destination)."""
    ends: dict[bool, dict[tuple, tuple[int, int, Action]]] = {True: {}, False: {}}
    for rank, program in enumerate(programs):
        for i, a in enumerate(program):
            if a.kind in SENDS or a.kind in RECVS:
                is_send = a.kind in SENDS
                key = (a.message_key(), rank, a.peer) if is_send \
                    else (a.message_key(), a.peer, rank)
                if key in ends[is_send]:
                    raise ProgramError(rank, i, a, "the same message is moved twice")
                ends[is_send][key] = (rank, i, a)
    for is_send, mine in ends.items():
        for key, (rank, i, a) in mine.items():
            if key not in ends[not is_send]:
                missing = "receive" if is_send else "send"
                raise ProgramError(rank, i, a, f"unmatched: no {missing} on rank {a.peer}")
