"""Where a step program lets a chunk's gradient buckets start their data-parallel
reductions inside a backward (parallel.overlap_grad_reduce): the executor arms that
backward (stageserver/executor.py), and the memory model counts the buckets' staging
there (coordinator/memory_model.py).
"""

from __future__ import annotations

from interleaf.protos.actions import Action, Kind


def overlapped_reductions(program: list[Action]) -> tuple[dict[int, int], dict[int, str]]:
    """(chunk -> the microbatch of the B that may start its buckets' reductions, chunk ->
    its reduction action's text) for every chunk the program reduces. A B may when it is
    the last action before the reduction to write the chunk's gradient: not when a W
    does, which writes outside autograd's hooks (stageserver/bucket_readiness.py).

    Worked example, one stage (pp 1) at ZeRO-0 with dp 2 and 2 microbatches:
    F0.0 B0.0 F0.1 B0.1 DP0 -> ({0: 1}, {0: "DP0"}); with a split backward,
    ... I0.1 W0.0 W0.1 DP0 -> ({}, {0: "DP0"})."""
    last_write: dict[int, Action] = {}
    overlapped, texts = {}, {}
    for a in program:
        if a.kind in (Kind.BACKWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT):
            last_write[a.chunk] = a
        elif a.kind in (Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS):
            texts[a.chunk] = str(a)
            if a.chunk in last_write and last_write[a.chunk].kind is Kind.BACKWARD:
                overlapped[a.chunk] = last_write[a.chunk].microbatch
    return overlapped, texts
