"""Helpers shared by the ZeRO schedule tests: the grid of layouts and a reference
walk of a ZeRO-3 program."""

from __future__ import annotations

import functools

from interleaf.coordinator.schedule import build_programs
from interleaf.protos.actions import Kind

F, B = Kind.FORWARD, Kind.BACKWARD
DP, RS = Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS
AG, RP = Kind.GATHER_PARAMS, Kind.RELEASE_PARAMS
OPT, SG = Kind.OPTIMIZER_STEP, Kind.SEND_GRAD

# (zero, prefetch): prefetch only means something under ZeRO-3.
STAGES = [(0, 1), (1, 1), (2, 1)] + [(3, p) for p in range(5)]
DPS = (1, 2, 3, 4)


def _layouts():
    """(schedule, pp, vpp, microbatches): every schedule, pp 1-4, vpp 1-3 where allowed,
    microbatches pp and 2*pp."""
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for pp in (1, 2, 3, 4):
            for vpp in ((1, 2, 3) if schedule == "interleaved-1f1b" else (1,)):
                for k in (1, 2):
                    yield schedule, pp, vpp, pp * k


LAYOUTS = list(_layouts())


@functools.lru_cache(maxsize=None)
def built(schedule, pp, vpp, m, dp, zero, prefetch):
    """Shared by the grid tests, which only read the programs."""
    return tuple(tuple(p) for p in build_programs(schedule, pp, vpp, m, dp, zero=zero,
                                                  prefetch=prefetch))


def owned(rank, pp, vpp):
    return list(range(rank, pp * vpp, pp))


def kinds(program, kind):
    return [(i, a.chunk) for i, a in enumerate(program) if a.kind is kind]


def last_backward(program, chunk):
    return max(i for i, a in enumerate(program) if a.kind is B and a.chunk == chunk)


def gathered_peak(program):
    """Walks a ZeRO-3 program as a stage server would hold parameters; asserts every
    compute runs on a gathered chunk, no chunk is gathered twice or released while not
    held, and nothing is held at the end. Returns the most chunks held at once."""
    held, peak = set(), 0
    for i, a in enumerate(program):
        if a.kind is AG:
            assert a.chunk not in held, f"{i} {a}: gathered twice"
            held.add(a.chunk)
            peak = max(peak, len(held))
        elif a.kind is RP:
            assert a.chunk in held, f"{i} {a}: released while not gathered"
            held.remove(a.chunk)
        elif a.kind in (F, B):
            assert a.chunk in held, f"{i} {a}: computes on a chunk that is not gathered"
    assert held == set(), f"still gathered at the end: {held}"
    return peak


