"""The timeline as a text table and as a matplotlib picture."""

from __future__ import annotations

import re
import struct

import numpy as np

from interleaf.coordinator.schedule import CostModel, build_programs, simulate, timeline_table, write_png
from interleaf.protos.actions import Kind
from tests.split_backward import split_backwards

UNIFORM = CostModel(forward_s=1.0, backward_s=1.0)


def test_table_places_each_action_in_its_slot():
    programs = build_programs("gpipe", 2, 1, 2, dp=1)
    table = timeline_table(programs, simulate(programs, UNIFORM))
    assert table.splitlines() == [
        "slot    0    1    2    3    4    5",
        "rank 0  F0.0 F0.1 .    .    B0.0 B0.1",
        "rank 1  .    F1.0 F1.1 B1.0 B1.1 .",
        "bubble fraction 0.3333 (makespan 6 forwards)",
    ]


def test_table_columns_line_up_for_interleaved():
    programs = build_programs("interleaved-1f1b", 4, 2, 8, dp=2)
    result = simulate(programs, UNIFORM)
    lines = timeline_table(programs, result).splitlines()
    columns = int(result.makespan_s)
    assert lines[0].split()[1:] == [str(i) for i in range(columns)]
    labels = 0
    for rank, line in enumerate(lines[1:5]):
        assert line.startswith(f"rank {rank}  ")
        for cell in re.finditer(r"\S+", line[8:]):
            assert cell.start() % 5 == 0  # every cell is 4 wide plus a separator
            span = result.timeline[rank]
            if cell.group() != ".":
                at = next(s for s in span if str(s.action) == cell.group())
                assert at.start == cell.start() // 5  # the column is the start slot
                labels += 1
    assert labels == 4 * 2 * 2 * 8
    assert lines[-1] == f"bubble fraction {3 / 19:.4f} (makespan {columns} forwards)"


def test_longer_backwards_span_several_slots():
    programs = build_programs("1f1b", 1, 1, 2, dp=1)
    table = timeline_table(programs, simulate(programs, CostModel(1.0, 2.0)))
    assert table.splitlines()[1] == "rank 0  F0.0 B0.0 -    F0.1 B0.1 -"


def test_png_is_labelled_and_draws_each_action_where_it_ran(tmp_path):
    programs = build_programs("interleaved-1f1b", 2, 2, 4, dp=1)
    result = simulate(programs, UNIFORM)
    path = tmp_path / "timeline.png"
    fig = write_png(str(path), programs, result, title="interleaved-1f1b: pp=2 vpp=2")
    width, height = struct.unpack(">II", path.read_bytes()[16:24])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (width, height) == (1400, round(100 * (2 * 0.42 + 1.15 + 0.5 + 0.55)))
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["pipeline rank 0", "pipeline rank 1"]
    assert ax.get_xlabel() == "time (one forward = 1)"
    assert ax.get_title(loc="left") == f"simulated: bubble fraction {1 / 9:.3f}, makespan 18"
    assert fig._suptitle.get_text() == "interleaved-1f1b: pp=2 vpp=2"
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "forward (virtual stage 0)", "forward (virtual stage 1)", "backward (virtual stage 0)",
        "backward (virtual stage 1)", "weight update", "send / receive / exchange",
        "all-reduce (DP, tied embedding)"]
    # Each compute is drawn in its kind's colour at its simulated time, with its microbatch.
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[:, :, :3]
    colours = {}
    for rank, spans in enumerate(result.timeline):
        for span in spans:
            if span.action.kind in (Kind.FORWARD, Kind.BACKWARD):
                x, y = ax.transData.transform(((span.start + span.end) / 2, rank - 0.4 + 0.56 * 0.85))
                colours.setdefault((span.action.kind, span.action.chunk // 2), set()).add(
                    tuple(pixels[pixels.shape[0] - round(y), round(x)]))
    assert all(len(found) == 1 for found in colours.values())  # one colour per kind and virtual stage
    assert len({c for found in colours.values() for c in found}) == 4
    first = next(s for s in result.timeline[1] if s.action.kind is Kind.FORWARD)
    idle = ax.transData.transform((first.start / 2, 1 - 0.2))  # rank 1 before its first forward
    assert tuple(pixels[pixels.shape[0] - round(idle[1]), round(idle[0])]) == (255, 255, 255)
    labels = {t.get_text() for t in ax.texts}
    assert labels == {"0", "1", "2", "3"}


# --- split backwards: the input- and weight-gradient halves I and W ----------------------------

SPLIT = (Kind.FORWARD, Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT)


def _split_step(schedule: str, pp: int, vpp: int, microbatches: int):
    """The planned programs with each B cut into I and a W deferred to the chunk's
    reduction (tests/split_backward.py), simulated with F, I and W a second each."""
    programs = [split_backwards(p, deferred=True) for p in build_programs(schedule, pp, vpp, microbatches, dp=1)]
    measured = [[1.0 if a.kind in SPLIT else None for a in p] for p in programs]
    return programs, simulate(programs, UNIFORM, measured=measured)


def test_table_shows_the_halves_of_a_split_backward():
    programs, result = _split_step("gpipe", 1, 1, 2)
    assert timeline_table(programs, result).splitlines() == [
        "slot    0    1    2    3    4    5",
        "rank 0  F0.0 F0.1 I0.0 I0.1 W0.0 W0.1",
        "bubble fraction 0.0000 (makespan 6 forwards)",
    ]


def _bar_pixel(fig, ax, rank: int, span):
    """The colour drawn in the middle of a compute's bar, near its top."""
    pixels = np.asarray(fig.canvas.buffer_rgba())[:, :, :3]
    x, y = ax.transData.transform(((span.start + span.end) / 2, rank - 0.4 + 0.56 * 0.85))
    return tuple(pixels[pixels.shape[0] - round(y), round(x)])


def test_png_draws_i_and_w_in_their_own_colours_with_their_microbatches(tmp_path):
    programs, result = _split_step("1f1b", 2, 1, 4)
    fig = write_png(str(tmp_path / "split.png"), programs, result, title="1f1b, split")
    (ax,) = fig.axes
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        "forward", "input gradient I", "weight gradient W", "weight update",
        "send / receive / exchange", "all-reduce (DP, tied embedding)"]
    fig.canvas.draw()
    colours = {}
    for rank, spans in enumerate(result.timeline):
        for span in spans:
            if span.action.kind in SPLIT:
                colours.setdefault(span.action.kind, set()).add(_bar_pixel(fig, ax, rank, span))
    assert all(len(found) == 1 for found in colours.values()) and len(colours) == 3
    assert len({c for found in colours.values() for c in found}) == 3
    # Every I and W carries its microbatch, in ink that shows on its colour.
    inks = {}
    for text in ax.texts:
        x, y = text.get_position()
        rank = round(y)  # the label sits in the middle of the upper lane, at rank - 0.12
        (span,) = [s for s in result.timeline[rank] if s.start < x < s.end]
        assert text.get_text() == str(span.action.microbatch)
        inks.setdefault(span.action.kind, set()).add(text.get_color())
    assert inks == {Kind.FORWARD: {"white"}, Kind.BACKWARD_INPUT: {"white"}, Kind.BACKWARD_WEIGHT: {"black"}}


def test_png_shades_i_and_w_by_virtual_stage(tmp_path):
    programs, result = _split_step("interleaved-1f1b", 2, 2, 4)
    fig = write_png(str(tmp_path / "split.png"), programs, result)
    (ax,) = fig.axes
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend[:6] == [f"{kind} (virtual stage {v})" for kind in
                          ("forward", "input gradient I", "weight gradient W") for v in (0, 1)]
    fig.canvas.draw()
    colours = {}
    for rank, spans in enumerate(result.timeline):
        for span in spans:
            if span.action.kind in SPLIT:
                colours.setdefault((span.action.kind, span.action.chunk // 2), set()).add(
                    _bar_pixel(fig, ax, rank, span))
    assert len(colours) == 6 and all(len(found) == 1 for found in colours.values())
    assert len({c for found in colours.values() for c in found}) == 6


def test_png_of_zbv_shades_each_rank_s_two_chunks_apart(tmp_path):
    """zbv's V puts chunks 0 and 3 on rank 0 and 1 and 2 on rank 1 (pp=2): each rank
    draws its first chunk as virtual stage 0 and its way back up as stage 1."""
    programs = build_programs("zbv", 2, 2, 4, dp=1)
    result = simulate(programs, CostModel())
    fig = write_png(str(tmp_path / "zbv.png"), programs, result)
    (ax,) = fig.axes
    assert [t.get_text() for t in fig.legends[0].get_texts()][:6] == [
        f"{kind} (virtual stage {v})" for kind in ("forward", "input gradient I", "weight gradient W") for v in (0, 1)]
    fig.canvas.draw()
    shades = {}
    for rank, spans in enumerate(result.timeline):
        for span in spans:
            if span.action.kind in SPLIT:
                shades.setdefault(_bar_pixel(fig, ax, rank, span), set()).add((span.action.kind, span.action.chunk))
    # One colour per kind and virtual stage: chunks 0 and 1 going down, 2 and 3 back up.
    assert {frozenset(found) for found in shades.values()} == {
        frozenset((kind, c) for c in chunks) for kind in SPLIT for chunks in ((0, 1), (2, 3))}
    assert timeline_table(programs, result).splitlines()[1].split()[2:5] == ["F0.0", "F0.1", "F0.2"]
