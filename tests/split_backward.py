"""Programs with split backwards for tests that need no zero-bubble schedule: a planned
program with each B cut into its halves by hand."""

from __future__ import annotations

from interleaf.protos.actions import REDUCTIONS, Action, Kind


def split_backwards(program: list[Action], deferred: bool) -> list[Action]:
    """Each B as I, with its W right after it or, deferred, all of a chunk's W's just
    before the chunk's (last) reduction, or before the tie reduction or optimizer step
    where a chunk is never reduced; gpipe, pp=1, m=2, deferred:

        F0.0 F0.1 B0.0 B0.1 OPT  ->  F0.0 F0.1 I0.0 I0.1 W0.0 W0.1 OPT
    """
    split: list[Action] = []
    waiting: dict[int, list[Action]] = {}
    for action in program:
        if action.kind is Kind.BACKWARD:
            split.append(Action(Kind.BACKWARD_INPUT, action.chunk, action.microbatch))
            weight = Action(Kind.BACKWARD_WEIGHT, action.chunk, action.microbatch)
            if deferred:
                waiting.setdefault(action.chunk, []).append(weight)
            else:
                split.append(weight)
            continue
        if action.kind in REDUCTIONS:
            split += waiting.pop(action.chunk, [])
        elif action.kind in (Kind.REDUCE_TIED_GRADS, Kind.OPTIMIZER_STEP):
            split += [w for chunk in sorted(waiting) for w in waiting.pop(chunk)]
        split.append(action)
    if waiting:
        raise ValueError(f"chunks {sorted(waiting)} have W's but the program ends without reducing them")
    return split
