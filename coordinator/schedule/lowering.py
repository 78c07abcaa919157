"""Passes 2 and 3 of lowering: point-to-point communication, then gradient sync
(ZeRO-3's parameter gathers are pass 4, in `zero.py`).

Each pass is a pure function from programs to programs; `build_programs` composes them
after `compute_order`. Point-to-point is two passes: `add_p2p` says which messages
exist (a receive before each compute that needs one, a send after each that makes
one), and `fuse.place_p2p` moves each to its message's tick and fuses a rank's
operations at one tick into one exchange, so the programs cannot deadlock under
rendezvous semantics (a send completes only when the peer reaches the matching
receive). Receives are posted ahead of their consumer: at the tick their tensor is
made, together with what the rank sends at that tick (see `fuse.py`). Messages are
matched by `Action.message_key()` plus peer, never by arrival order.
"""

from __future__ import annotations

from interleaf.protos.actions import INPUT_GRADS, WEIGHT_GRADS, Action, Kind

from .compute_order import compute_order
from .fuse import place_p2p
from .placement import chunk_ranks, chunks_on, tie_ranks
from .zero import add_param_gathers


def add_p2p(orders: list[list[Action]], placement: tuple[int, ...]) -> list[list[Action]]:
    """Inserts each receive right before the compute that consumes it and each send right
    after the compute that produces it.

    With eager links (sends buffered without limit) these programs deadlock only if the
    compute order is cyclic; under rendezvous semantics they deadlock wherever two
    neighbours both send before receiving, so `build_programs` hands them to
    `fuse.place_p2p`. Neighbouring chunks on the same rank (pp == 1, or the turn of
    zbv's V on the last rank) hand the tensor over locally, so they get no send or
    receive. An input-gradient backward (I) moves what a backward does; its weight half
    (W) moves nothing.

    Example, pp=2, vpp=1, rank 1: F1.0 B1.0 becomes RA1.0<0 F1.0 B1.0 SG1.0>0.
    """
    return [_p2p_for_rank(order, rank, placement) for rank, order in enumerate(orders)]


def _p2p_for_rank(order: list[Action], rank: int, placement: tuple[int, ...]) -> list[Action]:
    program: list[Action] = []
    last = len(placement) - 1
    for action in order:
        c, m = action.chunk, action.microbatch
        prev_rank = placement[c - 1] if c > 0 else rank
        next_rank = placement[c + 1] if c < last else rank
        takes_from_prev = prev_rank != rank
        talks_to_next = next_rank != rank
        if action.kind is Kind.FORWARD:
            before = [Action(Kind.RECV_ACT, c, m, prev_rank)] if takes_from_prev else []
            after = [Action(Kind.SEND_ACT, c, m, next_rank)] if talks_to_next else []
        elif action.kind in INPUT_GRADS:
            before = [Action(Kind.RECV_GRAD, c, m, next_rank)] if talks_to_next else []
            after = [Action(Kind.SEND_GRAD, c, m, prev_rank)] if takes_from_prev else []
        elif action.kind is Kind.BACKWARD_WEIGHT:
            before, after = [], []
        else:
            raise ValueError(f"add_p2p expects only compute actions, got {action}")
        program += before + [action] + after
    return program


def add_gradient_sync(program: list[Action], rank: int, placement: tuple[int, ...], dp: int,
                      tied_embedding_pipeline: bool, zero: int = 0) -> list[Action]:
    """Adds the gradient reductions and the optimizer step to one rank's program.

    - ZeRO-0 with dp > 1: REDUCE_GRADS(c) (an all-reduce) right after the last backward
      of chunk c on this rank that writes its gradients, B or W (and after the send of
      that backward's input gradient, alone or in an exchange, with any point-to-point
      action between), so the chunk's reduction overlaps the backwards still to run.
      Every chunk the rank owns (`placement`) must have a backward.
    - ZeRO-1/2/3: REDUCE_SCATTER_GRADS(c) at the same point: each data-parallel rank
      keeps the sum of its shard (stages 2 and 3 then free the full-size gradient). One
      reduction per chunk per step, as plain data parallelism: reducing after every run
      of backwards instead would hold less gradient for a few runs at the price of a
      reduce-scatter per run (with interleaving, several per chunk and step). After the
      optimizer step, ZeRO-1/2 gather the updated shards into the full working
      parameters (GATHER_PARAMS(c) per owned chunk); ZeRO-3's parameters are gathered
      where they are used, by `zero.add_param_gathers`.
    - `tied_embedding_pipeline` (the model ties its input and output embeddings) and
      more than one chunk: the embedding's two copies live with the first and the last
      chunk (ranks 0 and pp-1, or both on rank 0 under pp=1 or zbv's V, which then
      sums them locally), so those ranks append REDUCE_TIED_GRADS after all backwards. It
      sums whatever the optimizer reads: the full gradient under ZeRO-0, the shard
      otherwise (the embedding has a flat buffer of its own, so both copies' shards
      hold the same rows).
    - OPTIMIZER_STEP after every reduction.

    Order rule: reductions and REDUCE_TIED_GRADS are collectives, and every member of a
    group must issue its collectives in the same order (NCCL and gloo hang or mix up
    tensors otherwise). A chunk's reductions and gathers run in the DP group of its
    owner: all its members are replicas of this pipeline rank and run this very
    program, so their order matches. REDUCE_TIED_GRADS is the only collective of the
    two-member tie group (ranks 0 and pp-1), and each of them issues it once.
    """
    if zero or dp > 1:
        reduce_after = _reduction_points(program, rank, placement)
    else:
        reduce_after = {}
    kind = Kind.REDUCE_SCATTER_GRADS if zero else Kind.REDUCE_GRADS
    synced: list[Action] = []
    for i, action in enumerate(program):
        synced.append(action)
        if i in reduce_after:
            synced.append(Action(kind, reduce_after[i]))
    if tied_embedding_pipeline and len(placement) > 1 and rank in tie_ranks(placement):
        synced.append(Action(Kind.REDUCE_TIED_GRADS))
    synced.append(Action(Kind.OPTIMIZER_STEP))
    if zero in (1, 2):
        synced += [Action(Kind.GATHER_PARAMS, c) for c in chunks_on(placement, rank)]
    return synced


def _after_send_grad(program: list[Action], index: int) -> int:
    # The send of the backward's input gradient (if any, alone or in an exchange) stays
    # directly behind it, with the point-to-point actions of earlier ticks that came
    # due during the backward: the upstream rank waits at its matching receive and
    # should not wait out our reduction too.
    backward = program[index]
    send = Action(Kind.SEND_GRAD, backward.chunk, backward.microbatch)
    end = index + 1
    while end < len(program) and program[end].p2p_ops():
        if any(op.kind is Kind.SEND_GRAD and op.message_key() == send.message_key()
               for op in program[end].p2p_ops()):
            return end
        end += 1
    return index


def _reduction_points(program: list[Action], rank: int, placement: tuple[int, ...]) -> dict[int, int]:
    """Maps the index after which each owned chunk's reduction goes to that chunk."""
    last_backward = {a.chunk: i for i, a in enumerate(program) if a.kind in WEIGHT_GRADS}
    points = {}
    for chunk in chunks_on(placement, rank):
        if chunk not in last_backward:
            raise ValueError(f"rank {rank} owns chunk {chunk} but its program has no "
                             f"backward for it, so its gradients would never be reduced")
        points[_after_send_grad(program, last_backward[chunk])] = chunk
    return points


def build_programs(schedule: str, pp: int, vpp: int, microbatches: int,
                   dp: int, zero: int = 0, prefetch: int = 1, tied: bool = True) -> list[list[Action]]:
    """One program per pipeline rank; its DP and TP replicas run the same program.

    `tied`: the model ties its input and output embeddings (model.tie_embeddings), so
    the tie reduction is added whenever the model has several chunks. Untied, the
    embedding lives only with the first chunk and the head only with the last.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} must be 0, 1, 2 or 3")
    placement = chunk_ranks(schedule, pp, vpp)
    programs = add_p2p(compute_order(schedule, pp, vpp, microbatches), placement)
    programs = place_p2p(programs, pair_steady_state=schedule == "interleaved-1f1b" and vpp > 1)
    programs = [
        add_gradient_sync(program, rank, placement, dp, tied_embedding_pipeline=tied, zero=zero)
        for rank, program in enumerate(programs)
    ]
    if zero == 3:
        programs = [add_param_gathers(program, prefetch) for program in programs]
    return programs
