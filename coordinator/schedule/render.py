"""Draws a simulated step: a text table for logs and terminals, and a PNG.

The table places each compute action at its simulated start time. The time slot is the
shortest compute duration, so with a uniform cost model (forward_s == backward_s) every
action fills exactly one column; otherwise longer actions span several columns and
starts are rounded to the nearest slot. Only the computes of microbatches are in it
(forwards, backwards, and the input- and weight-gradient halves I and W of the
zero-bubble schedules); the rest of the time shows as idle, which is what the bubble
fraction counts. The PNG is drawn by picture.py, with every action.
"""

from __future__ import annotations

import math

from interleaf.protos.actions import COMPUTE, Action
from .simulate import SimResult, Span

_IDLE, _CONTINUED = ".", "-"


def timeline_table(programs: list[list[Action]], result: SimResult) -> str:
    """One row per rank, one column per time slot; gpipe, pp=2, m=2, uniform costs:

        slot    0    1    2    3    4    5
        rank 0  F0.0 F0.1 .    .    B0.0 B0.1
        rank 1  .    F1.0 F1.1 B1.0 B1.1 .
        bubble fraction 0.3333 (makespan 6 forwards)

    A "-" continues the action to its left (a backward costing two forwards). A split
    backward shows as its halves, B0.0 as I0.0 and W0.0 wherever the program put each.
    """
    spans = _compute_spans(programs, result)
    slot = _slot_s(spans)
    columns = math.ceil(result.makespan_s / slot - 1e-9) if slot else 0
    rows = []
    for rank_spans in spans:
        cells = [_IDLE] * columns
        for span in rank_spans:
            first, width = _slots(span, slot)
            cells[first:first + width] = [str(span.action)] + [_CONTINUED] * (width - 1)
        rows.append(cells)
    cell_width = max([len(c) for row in rows for c in row] + [len(str(columns))])
    lines = ["slot    " + " ".join(str(i).ljust(cell_width) for i in range(columns))]
    lines += [f"rank {r:<2} " + " ".join(c.ljust(cell_width) for c in row)
              for r, row in enumerate(rows)]
    # `interleaf schedule` simulates with CostModel()'s costs, not measured seconds: a
    # forward costs 1, so the makespan counts forwards' time (as write_png's axis does).
    lines.append(f"bubble fraction {result.bubble_fraction:.4f} (makespan {result.makespan_s:g} forwards)")
    return "\n".join(line.rstrip() for line in lines)


def write_png(path: str, programs: list[list[Action]], result: SimResult, title: str = "",
              time_label: str = "time (one forward = 1)"):
    """Draws the simulated step with matplotlib (coordinator/schedule/picture.py): a row per
    pipeline rank, every action (computes above, communication and ZeRO below),
    microbatch numbers, a time axis, a legend, the bubble fraction in the title.
    Returns the figure."""
    from . import picture  # imported here: only pictures need matplotlib

    _compute_spans(programs, result)  # the same number of ranks
    pp = len(programs)
    vpp = 1 + max((a.chunk // pp for p in programs for a in p if a.kind in COMPUTE), default=0)
    panel = picture.Panel(
        f"simulated: bubble fraction {result.bubble_fraction:.3f}, makespan {result.makespan_s:g}",
        [(f"pipeline rank {r}", picture.sim_bars(spans, pp)) for r, spans in enumerate(result.timeline)])
    return picture.write(path, [panel], time_label, title, shades=vpp)


def _compute_spans(programs: list[list[Action]], result: SimResult) -> list[list[Span]]:
    if len(programs) != len(result.timeline):
        raise ValueError(f"{len(programs)} programs but {len(result.timeline)} simulated "
                         f"ranks")
    return [[s for s in spans if s.action.kind in COMPUTE] for spans in result.timeline]


def _slot_s(spans: list[list[Span]]) -> float:
    """The shortest compute duration, or 0 when nothing computes."""
    return min((s.end - s.start for rank in spans for s in rank if s.end > s.start),
               default=0.0)


def _slots(span: Span, slot: float) -> tuple[int, int]:
    first = round(span.start / slot)
    return first, max(1, round(span.end / slot) - first)
