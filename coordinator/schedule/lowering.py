"""Passes 2 and 3 of lowering: point-to-point communication, then gradient sync.

Each pass is a pure function from programs to programs; `build_programs` composes them
after `compute_order`. The executor and the simulator read the result with these
semantics: sends are non-blocking (the tensor is handed to the network and the rank
goes on), receives block until their message has arrived, and messages are matched by
`Action.message_key()` plus peer, never by arrival order.
"""

from __future__ import annotations

from protos.actions import Action, Kind
from .compute_order import compute_order


def add_p2p(orders: list[list[Action]], pp: int, vpp: int) -> list[list[Action]]:
    """Inserts each receive right before the compute that consumes it and each send right
    after the compute that produces it.

    Because sends never block, a receive placed just before its consumer adds no wait
    beyond the data dependency itself, so the programs deadlock only if the compute
    order is cyclic, which `simulate` detects. Neighbouring chunks on the same rank
    (pp == 1) hand the tensor over locally, so they get no send or receive.

    Example, pp=2, vpp=1, rank 1: F1.0 B1.0 becomes RA1.0<0 F1.0 B1.0 SG1.0>0.
    """
    return [_p2p_for_rank(order, rank, pp, pp * vpp - 1) for rank, order in enumerate(orders)]


def _p2p_for_rank(order: list[Action], rank: int, pp: int, last: int) -> list[Action]:
    program: list[Action] = []
    for action in order:
        c, m = action.chunk, action.microbatch
        prev_rank, next_rank = (c - 1) % pp, (c + 1) % pp
        takes_from_prev = c > 0 and prev_rank != rank
        talks_to_next = c < last and next_rank != rank
        if action.kind is Kind.FORWARD:
            before = [Action(Kind.RECV_ACT, c, m, prev_rank)] if takes_from_prev else []
            after = [Action(Kind.SEND_ACT, c, m, next_rank)] if talks_to_next else []
        elif action.kind is Kind.BACKWARD:
            before = [Action(Kind.RECV_GRAD, c, m, next_rank)] if talks_to_next else []
            after = [Action(Kind.SEND_GRAD, c, m, prev_rank)] if takes_from_prev else []
        else:
            raise ValueError(f"add_p2p expects only compute actions, got {action}")
        program += before + [action] + after
    return program


def add_gradient_sync(program: list[Action], rank: int, pp: int, vpp: int, dp: int,
                      tied_embedding_pipeline: bool) -> list[Action]:
    """Adds the gradient reductions and the optimizer step to one rank's program.

    - dp > 1: REDUCE_GRADS(c) right after the last backward of chunk c on this rank
      (and after that backward's SEND_GRAD), so the chunk's data-parallel reduction
      overlaps the backwards still to run. Every chunk the rank owns (rank, rank+pp,
      ... below pp*vpp) must have a backward.
    - `tied_embedding_pipeline` (the model ties its input and output embeddings) and
      more than one chunk: the embedding's two copies live with chunk 0 on rank 0 and
      with the last chunk on rank pp-1, so those ranks append REDUCE_TIED_GRADS after
      all backwards (with pp=1 both copies are on rank 0 and it sums them locally).
    - OPTIMIZER_STEP comes last on every rank.

    Order rule: REDUCE_GRADS and REDUCE_TIED_GRADS are collectives, and every member of
    a group must issue its collectives in the same order (NCCL and gloo hang or mix up
    tensors otherwise). REDUCE_GRADS(c) runs in the DP group of chunk c's owner: all its
    members are replicas of this pipeline rank and run this very program, so their
    order matches. REDUCE_TIED_GRADS is the only collective of the two-member tie group
    (ranks 0 and pp-1), and each of them issues it once.
    """
    reduce_after = _reduction_points(program, rank, pp, vpp) if dp > 1 else {}
    synced: list[Action] = []
    for i, action in enumerate(program):
        synced.append(action)
        if i in reduce_after:
            synced.append(Action(Kind.REDUCE_GRADS, reduce_after[i]))
    if tied_embedding_pipeline and pp * vpp > 1 and rank in (0, pp - 1):
        synced.append(Action(Kind.REDUCE_TIED_GRADS))
    synced.append(Action(Kind.OPTIMIZER_STEP))
    return synced


def _reduction_points(program: list[Action], rank: int, pp: int, vpp: int) -> dict[int, int]:
    """Maps the index after which each owned chunk's REDUCE_GRADS goes to that chunk."""
    last_backward = {a.chunk: i for i, a in enumerate(program) if a.kind is Kind.BACKWARD}
    points = {}
    for chunk in range(rank, pp * vpp, pp):
        if chunk not in last_backward:
            raise ValueError(f"rank {rank} owns chunk {chunk} but its program has no "
                             f"backward for it, so its gradients would never be reduced")
        index = last_backward[chunk]
        # The backward's SEND_GRAD (if any) stays directly behind it: the send is
        # non-blocking, and the upstream rank should not wait out our reduction.
        if index + 1 < len(program) and program[index + 1].kind is Kind.SEND_GRAD:
            index += 1
        points[index] = chunk
    return points


def build_programs(schedule: str, pp: int, vpp: int, microbatches: int,
                   dp: int) -> list[list[Action]]:
    """One program per pipeline rank; its DP and TP replicas run the same program.

    GPT's input and output embeddings are always tied (DESIGN.md, "Model and tensor
    parallelism"), so the tie reduction is added whenever the model has several chunks.
    """
    programs = add_p2p(compute_order(schedule, pp, vpp, microbatches), pp, vpp)
    return [
        add_gradient_sync(program, rank, pp, vpp, dp, tied_embedding_pipeline=True)
        for rank, program in enumerate(programs)
    ]
