"""Pass 4 of lowering (ZeRO-3): when each rank gathers and releases its chunks'
parameters.

Under ZeRO-3 a rank owns 1/dp of every chunk's parameters. A chunk's full parameters
exist only while the program computes with them: they are gathered before a *run* (a
maximal stretch of consecutive forwards and backwards of one chunk, sends, receives and
exchanges in between not counting) and released after it. A weight-gradient backward
(W) reads no parameter, only what its input-gradient half kept, so it runs wherever
the zero-bubble schedule put it, gathered or not, and belongs to no run. So with interleaved 1F1B,
pp=2, vpp=2, rank 0's runs are F0.0 F0.1 | F2.0 F2.1 | F0.2 F0.3 | ..., and at most
`prefetch + 1` chunks are gathered at once.

`prefetch` says how far ahead a gather is issued: the gather of run j goes in front of
the first compute of run j - prefetch, so (with prefetch 1) the next chunk's all-gather
travels while the current chunk computes, and the compute that needs it waits only for
whatever is left of the transfer. Should a run's gather fall while the same chunk is
still held by an earlier run (prefetch reaching past a run of another chunk back to
this one) or before any other compute would run, the two runs merge: the chunk stays
gathered across the gap, with no release and gather in between.
"""

from __future__ import annotations

from dataclasses import dataclass

from interleaf.protos.actions import READS_PARAMS, Action, Kind


@dataclass(frozen=True)
class Run:
    chunk: int
    indices: tuple[int, ...]
    """Program indices of the run's forwards and backwards, in order."""


def compute_runs(program: list[Action]) -> list[Run]:
    """The program's maximal stretches of compute on one chunk, in program order."""
    runs: list[Run] = []
    for i, action in enumerate(program):
        if action.kind not in READS_PARAMS:
            continue
        if runs and runs[-1].chunk == action.chunk:
            runs[-1] = Run(action.chunk, runs[-1].indices + (i,))
        else:
            runs.append(Run(action.chunk, (i,)))
    return runs


def add_param_gathers(program: list[Action], prefetch: int) -> list[Action]:
    """Inserts GATHER_PARAMS(c) `prefetch` runs ahead of each run of chunk c and
    RELEASE_PARAMS(c) right after the run's last compute.

    Example, rank 0 of interleaved pp=2 vpp=4, m=4 (sends and receives left out):
        F0.0 F0.1 F2.0 F2.1 F4.0 ...
    prefetch 0:  AG0 F0.0 F0.1 RP0 AG2 F2.0 F2.1 RP2 AG4 F4.0 ...
    prefetch 1:  AG0 AG2 F0.0 F0.1 RP0 AG4 F2.0 F2.1 RP2 AG6 F4.0 ...
    With vpp=2 and prefetch 1 a chunk would be gathered again right after its release
    (runs alternate 0, 2, 0, 2), so both chunks stay gathered throughout.
    """
    if prefetch < 0:
        raise ValueError(f"prefetch={prefetch} must be >= 0")
    runs = compute_runs(program)
    gathers = [True] * len(runs)
    releases = [True] * len(runs)
    anchors = [_before_receives(program, runs[max(0, j - prefetch)].indices[0])
               for j in range(len(runs))]
    last_of: dict[int, int] = {}
    for j, run in enumerate(runs):
        i = last_of.get(run.chunk)
        # Still held when its gather would be issued, or to be gathered again before
        # any other compute ran: keep it across the gap instead.
        if i is not None and not any(a.kind in READS_PARAMS for a in program[runs[i].indices[-1] + 1:anchors[j]]):
            releases[i] = gathers[j] = False
        last_of[run.chunk] = j
    before: dict[int, list[Action]] = {}
    after: dict[int, Action] = {}
    for j, run in enumerate(runs):
        if gathers[j]:
            before.setdefault(anchors[j], []).append(Action(Kind.GATHER_PARAMS, run.chunk))
        if releases[j]:
            after[run.indices[-1]] = Action(Kind.RELEASE_PARAMS, run.chunk)
    lowered: list[Action] = []
    for i, action in enumerate(program):
        lowered += before.get(i, [])
        lowered.append(action)
        if i in after:
            lowered.append(after[i])
    return lowered


def _before_receives(program: list[Action], index: int) -> int:
    """Moves a gather in front of the point-to-point actions right before its compute
    (receives it waits on, alone or in exchanges), so the gather travels during that
    wait too."""
    while index > 0 and program[index - 1].p2p_ops():
        index -= 1
    return index


def max_gathered(program: list[Action]) -> int:
    """The most chunks a program holds gathered at once."""
    held: set[int] = set()
    most = 0
    for action in program:
        if action.kind is Kind.GATHER_PARAMS:
            held.add(action.chunk)
            most = max(most, len(held))
        elif action.kind is Kind.RELEASE_PARAMS:
            held.discard(action.chunk)
    return most
