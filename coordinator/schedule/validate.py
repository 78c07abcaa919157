"""Checks on lowered programs: static rules, then the dynamic one, that the programs
run to the end under rendezvous semantics (`simulate`, `links.py`).

Every failure names the rank, the action index and the action, because that is what
an engineer needs to find the bad pass, and what a stage server reports when a step
fails at run time.
"""

from __future__ import annotations

from interleaf.protos.actions import COMPUTE, INPUT_GRADS, PER_CHUNK, RECVS, SENDS, WEIGHT_GRADS, Action, Kind

from .errors import ProgramError
from .links import link_of
from .placement import chunks_on, round_robin, tie_ranks
from .simulate import CostModel, simulate
from .zero_rules import check_zero


def validate_programs(programs: list[list[Action]], pp: int, vpp: int,
                      microbatches: int, zero: int = 0, forward_only: bool = False,
                      placement: tuple[int, ...] | None = None) -> None:
    """Raises ProgramError on the first rule a program breaks:

    - every action's chunk lives on its rank under `placement` (placement.py; None:
      round-robin, chunk c on rank c % pp), and every send/receive names the rank that
      owns the neighbouring chunk;
    - each (chunk, microbatch) has exactly one forward and either one backward (B) or
      one input-gradient backward (I) and one weight-gradient backward (W), in the
      order F, I, W;
    - every send has exactly one matching receive on its peer and vice versa, an
      exchange's members included, and between any two ranks the messages one way are
      received in the order they are sent (NCCL matches point-to-point messages by
      order, not by tag: two same-sized tensors swapped would arrive silently swapped);
    - a receive comes before the compute that consumes it, a send after the one that
      produces it; a chunk's REDUCE_GRADS comes once, after all of its backwards;
    - REDUCE_TIED_GRADS is only on the ranks of the first and last chunk; OPTIMIZER_STEP appears once,
      last (under ZeRO-1/2 followed only by the gathers of the updated parameters);
    - the ZeRO rules of `zero_rules.check_zero` for the stage: the reductions and
      gathers it uses, no use of a parameter before its gather or after its release;
    - and then, with all that holding, no deadlock under rendezvous semantics: a
      send completes only when its peer reaches the matching receive, an exchange
      when all of its members' partners are posted (raises `DeadlockError`, naming
      every blocked rank, its action and the operations it waits for).

    `forward_only` (an evaluation program, forward_only.py): each (chunk, microbatch)
    has exactly one forward and nothing else computes; no gradient moves or is reduced,
    no optimizer step runs, and only ZeRO-3's gathers and releases are allowed.
    """
    if len(programs) != pp:
        raise ValueError(f"got {len(programs)} programs for pp={pp}")
    placement = round_robin(pp, vpp) if placement is None else placement
    if len(placement) != pp * vpp or set(placement) != set(range(pp)):
        raise ValueError(f"placement {placement} does not put pp*vpp={pp * vpp} chunks on {pp} ranks")
    for rank, program in enumerate(programs):
        if forward_only:
            _check_forward_only(program, rank)
        _check_placement(program, rank, placement, optimizer_steps=0 if forward_only else 1)
        _check_compute(program, rank, chunks_on(placement, rank), microbatches, forward_only)
        _check_ordering(program, rank, placement)
        check_zero(program, rank, chunks_on(placement, rank), zero, forward_only)
    tying = {r for r, program in enumerate(programs) if any(a.kind is Kind.REDUCE_TIED_GRADS for a in program)}
    if tying and tying != set(tie_ranks(placement)):
        raise ProgramError(min(tying), None, None, f"the tied embedding is summed on ranks {sorted(tying)}, "
                                                   f"but its copies live on ranks {sorted(set(tie_ranks(placement)))}")
    _check_matching(programs)
    _check_pair_order(programs)
    simulate(programs, CostModel(), links="rendezvous")


_FORWARD_ONLY = frozenset({Kind.FORWARD, Kind.SEND_ACT, Kind.RECV_ACT, Kind.EXCHANGE, Kind.GATHER_PARAMS,
                           Kind.RELEASE_PARAMS})


def _check_forward_only(program: list[Action], rank: int) -> None:
    for i, a in enumerate(program):
        for b in (a.p2p_ops() or (a,)):
            if b.kind not in _FORWARD_ONLY:
                raise ProgramError(rank, i, a, f"{_member(b, a)}a forward-only program has no {b.kind.name}")


def _check_placement(program: list[Action], rank: int, placement: tuple[int, ...],
                     optimizer_steps: int = 1) -> None:
    for i, a in enumerate(program):
        for b in (a.p2p_ops() or (a,)):
            _check_chunk_and_peer(b, rank, placement, i, a)
        if a.kind is Kind.REDUCE_TIED_GRADS and (len(placement) == 1 or rank not in tie_ranks(placement)):
            raise ProgramError(rank, i, a, "only the ranks of the first and last of several "
                                           "chunks hold a copy of the tied embedding")
        if a.kind is Kind.OPTIMIZER_STEP and any(b.kind is not Kind.GATHER_PARAMS
                                                 for b in program[i + 1:]):
            raise ProgramError(rank, i, a, "the optimizer step must be the last action "
                                           "(but for the gathers of the updated parameters)")
    if sum(a.kind is Kind.OPTIMIZER_STEP for a in program) != optimizer_steps:
        raise ProgramError(rank, None, None, f"program must have exactly {optimizer_steps} OPT")


def _check_chunk_and_peer(b: Action, rank: int, placement: tuple[int, ...], i: int, a: Action) -> None:
    """Checks `b`, which is action `a` at index `i` or one of its exchange's members."""
    member = _member(b, a)
    lives_somewhere = b.kind in COMPUTE | SENDS | RECVS | PER_CHUNK
    if lives_somewhere and (not 0 <= b.chunk < len(placement) or placement[b.chunk] != rank):
        raise ProgramError(rank, i, a, f"{member}chunk {b.chunk} does not live on rank "
                                       f"{rank} (the placement puts chunks {chunks_on(placement, rank)} there)")
    if b.kind in SENDS or b.kind in RECVS:
        neighbour = b.message_key()[1] if b.kind in SENDS else _source_chunk(b)
        if not 0 <= neighbour < len(placement):
            raise ProgramError(rank, i, a, f"{member}chunk {neighbour} does not exist")
        if b.peer != placement[neighbour]:
            raise ProgramError(rank, i, a, f"{member}peer should be rank {placement[neighbour]}, "
                                           f"which holds chunk {neighbour}")


def _source_chunk(recv: Action) -> int:
    """The chunk that produces what `recv` receives: the previous chunk's activation, or
    the next chunk's input gradient."""
    return recv.chunk - 1 if recv.kind is Kind.RECV_ACT else recv.chunk + 1


_COMES_AFTER = {Kind.BACKWARD: Kind.FORWARD, Kind.BACKWARD_INPUT: Kind.FORWARD,
                Kind.BACKWARD_WEIGHT: Kind.BACKWARD_INPUT}
_NAMES = {Kind.BACKWARD: "backward", Kind.BACKWARD_INPUT: "input-gradient backward",
          Kind.BACKWARD_WEIGHT: "weight-gradient backward"}


def _check_compute(program: list[Action], rank: int, owned: list[int], microbatches: int,
                   forward_only: bool = False) -> None:
    seen: dict[tuple[Kind, int, int], int] = {}
    for i, a in enumerate(program):
        if a.kind not in COMPUTE:
            continue
        key = (a.kind, a.chunk, a.microbatch)
        if key in seen:
            raise ProgramError(rank, i, a, f"repeats action {seen[key]}")
        if not 0 <= a.microbatch < microbatches:
            raise ProgramError(rank, i, a, f"microbatch outside 0..{microbatches - 1}")
        before = _COMES_AFTER.get(a.kind)
        if before is not None and (before, a.chunk, a.microbatch) not in seen:
            raise ProgramError(rank, i, a, f"{_NAMES[a.kind]} before {Action(before, a.chunk, a.microbatch)}")
        seen[key] = i
    for chunk in owned:
        for m in range(microbatches):
            split = (Kind.BACKWARD_INPUT, chunk, m) in seen or (Kind.BACKWARD_WEIGHT, chunk, m) in seen
            kinds = [Kind.FORWARD]
            if not forward_only:
                kinds += [Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT] if split else [Kind.BACKWARD]
            for kind in kinds:
                if (kind, chunk, m) not in seen:
                    raise ProgramError(rank, None, None, f"program lacks {Action(kind, chunk, m)}")
            if split and (Kind.BACKWARD, chunk, m) in seen:
                raise ProgramError(rank, seen[(Kind.BACKWARD, chunk, m)], Action(Kind.BACKWARD, chunk, m),
                                   "runs both the fused backward and its halves")


def _check_ordering(program: list[Action], rank: int, placement: tuple[int, ...]) -> None:
    last = len(placement) - 1
    index = {a: i for i, a in enumerate(program)}
    received = {op.message_key(): i for i, a in enumerate(program) for op in a.p2p_ops()
                if op.kind in RECVS}
    reduced: dict[int, int] = {}
    for i, a in enumerate(program):
        for op in a.p2p_ops():
            if op.kind in SENDS:
                makers = [Kind.FORWARD] if op.kind is Kind.SEND_ACT else [Kind.BACKWARD, Kind.BACKWARD_INPUT]
                producer = next((p for p in (Action(k, op.chunk, op.microbatch) for k in makers) if p in index),
                                Action(makers[0], op.chunk, op.microbatch))
                if index.get(producer, len(program)) > i:
                    raise ProgramError(rank, i, a, f"{_member(op, a)}sent before {producer} "
                                                   f"produces it")
        c, m = a.chunk, a.microbatch
        if a.kind is Kind.FORWARD and c > 0 and placement[c - 1] != rank:
            needed = ("act", c, m)
        elif a.kind in INPUT_GRADS and c < last and placement[c + 1] != rank:
            needed = ("grad", c, m)
        elif a.kind is Kind.REDUCE_GRADS:
            if c in reduced:
                raise ProgramError(rank, i, a, f"chunk {c} was reduced at action {reduced[c]}")
            reduced[c] = i
            backwards = [j for b, j in index.items()
                         if b.kind in WEIGHT_GRADS and b.chunk == c]
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
    ends: dict[bool, dict[tuple, tuple[int, int, Action, Action]]] = {True: {}, False: {}}
    for rank, program in enumerate(programs):
        for i, a in enumerate(program):
            for op in a.p2p_ops():
                is_send = op.kind in SENDS
                key = link_of(rank, op)
                if key in ends[is_send]:
                    raise ProgramError(rank, i, a, f"{_member(op, a)}the same message is "
                                                   f"moved twice")
                ends[is_send][key] = (rank, i, a, op)
    for is_send, mine in ends.items():
        for key, (rank, i, a, op) in mine.items():
            if key not in ends[not is_send]:
                missing = "receive" if is_send else "send"
                raise ProgramError(rank, i, a, f"{_member(op, a)}unmatched: no {missing} on "
                                               f"rank {op.peer}")


def _check_pair_order(programs: list[list[Action]]) -> None:
    """For every (sender, receiver) pair: the receiver posts its receives in the order the
    sender posts its sends, program order and, within an exchange, member order."""
    sent: dict[tuple[int, int], list[tuple]] = {}
    received: dict[tuple[int, int], list[tuple[tuple, int, int, Action]]] = {}
    for rank, program in enumerate(programs):
        for i, a in enumerate(program):
            for op in a.p2p_ops():
                if op.kind in SENDS:
                    sent.setdefault((rank, op.peer), []).append(op.message_key())
                else:
                    received.setdefault((op.peer, rank), []).append((op.message_key(), i, rank, a))
    for pair, keys in received.items():
        for position, (key, i, rank, a) in enumerate(keys):
            expected = sent[pair][position]
            if key != expected:
                raise ProgramError(rank, i, a, f"receives from rank {pair[0]} out of order: message "
                                               f"{position} from it is {expected}, not {key}")


def _member(op: Action, action: Action) -> str:
    """Names the exchange member an error is about ("" for a plain action)."""
    return f"{op}: " if op is not action else ""
