"""The validator's ZeRO rules for one rank's program (see `validate.validate_programs`).

Which reductions and gathers each stage uses:
    stage 0   DP c (all-reduce) once per chunk after its backwards, when dp > 1;
    stage 1/2 RS c (reduce-scatter) once per chunk after its backwards, and AG c once per
              chunk after OPT (the updated shards gathered into the full parameters);
    stage 3   RS c as stages 1/2 (any RS covers the gradient-writing backwards, B or W,
              since the chunk's last one, and every one must be covered), AG c / RP c
              around the compute: no forward or backward that reads parameters (F, B,
              I; not W) of a chunk that is not gathered, no gather of a gathered chunk,
              no release of one that is not, nothing left gathered.
"""

from __future__ import annotations

from interleaf.protos.actions import READS_PARAMS, WEIGHT_GRADS, Action, Kind
from .errors import ProgramError


def check_zero(program: list[Action], rank: int, owned: list[int], zero: int, forward_only: bool = False) -> None:
    """`forward_only` (an evaluation program): no reductions at any stage, and gathers
    only under ZeRO-3, around the forwards (stages 1/2 hold whole parameters then)."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero} must be 0, 1, 2 or 3")
    def fail(i: int | None, reason: str):
        raise ProgramError(rank, i, program[i] if i is not None else None, reason)

    allowed = {0: {Kind.REDUCE_GRADS}, 1: {Kind.REDUCE_SCATTER_GRADS, Kind.GATHER_PARAMS},
               2: {Kind.REDUCE_SCATTER_GRADS, Kind.GATHER_PARAMS},
               3: {Kind.REDUCE_SCATTER_GRADS, Kind.GATHER_PARAMS, Kind.RELEASE_PARAMS}}[zero]
    if forward_only:
        allowed = {Kind.GATHER_PARAMS, Kind.RELEASE_PARAMS} if zero == 3 else set()
    zero_kinds = {Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS, Kind.GATHER_PARAMS,
                  Kind.RELEASE_PARAMS}
    optimizer = next((i for i, a in enumerate(program) if a.kind is Kind.OPTIMIZER_STEP),
                     len(program))
    gathered: set[int] = set()
    unreduced: dict[int, int] = {}  # chunk -> a backward not yet covered by an RS
    scattered: dict[int, int] = {}  # chunk -> RS count
    for i, a in enumerate(program):
        if a.kind in zero_kinds and a.kind not in allowed:
            fail(i, f"ZeRO stage {zero} has no {a.kind.name}")
        if a.kind is Kind.GATHER_PARAMS:
            if zero in (1, 2) and i < optimizer:
                fail(i, f"ZeRO-{zero} gathers parameters only after the optimizer step")
            if zero == 3 and i > optimizer:
                fail(i, "ZeRO-3 gathers nothing after the optimizer step")
            if a.chunk in gathered:
                fail(i, f"chunk {a.chunk} is already gathered")
            gathered.add(a.chunk)
        elif a.kind is Kind.RELEASE_PARAMS:
            if a.chunk not in gathered:
                fail(i, f"chunk {a.chunk} is not gathered")
            gathered.discard(a.chunk)
        elif a.kind in READS_PARAMS or a.kind in WEIGHT_GRADS:
            if zero == 3 and a.kind in READS_PARAMS and a.chunk not in gathered:
                fail(i, f"uses chunk {a.chunk}'s parameters, which are not gathered "
                        f"(no AG{a.chunk} before it, or released since)")
            if a.kind in WEIGHT_GRADS:
                unreduced.setdefault(a.chunk, i)
        elif a.kind is Kind.REDUCE_SCATTER_GRADS:
            if a.chunk not in unreduced:
                fail(i, f"no backward of chunk {a.chunk} since its last reduction")
            del unreduced[a.chunk]
            scattered[a.chunk] = scattered.get(a.chunk, 0) + 1
    if zero == 3 and gathered:
        fail(None, f"chunks {sorted(gathered)} are still gathered at the end")
    if zero and not forward_only:
        for chunk, i in sorted(unreduced.items()):
            fail(i, f"chunk {chunk}'s gradient is never reduce-scattered after this backward")
        for chunk in sorted(owned):
            if zero in (1, 2) and scattered.get(chunk) != 1:
                fail(None, f"ZeRO-{zero} reduce-scatters chunk {chunk} once, not "
                           f"{scattered.get(chunk, 0)} times")
            if zero in (1, 2) and sum(a.kind is Kind.GATHER_PARAMS and a.chunk == chunk
                                      for a in program) != 1:
                fail(None, f"ZeRO-{zero} gathers chunk {chunk}'s updated parameters once "
                           f"after the optimizer step")
