"""Timeline pictures, drawn with matplotlib: `interleaf schedule --png` (the simulated
step) and `interleaf trace --png` (the executed step above the simulator's prediction).

A picture is a stack of panels sharing one time axis. Each panel has a row per rank
(rank 0 on top), and each row two lanes: computes in the wide upper lane (forward,
backward or its two halves, the input gradient I and the weight gradient W of the
zero-bubble schedules, the weight update, and the time a compute waited for its inputs
before it ran), everything else in the thin lower lane (point-to-point sends, receives
and exchanges, data-parallel and tied-embedding all-reduces, ZeRO's gathers, releases
and reduce-scatters). Forwards and backwards, and their halves, carry their microbatch
number; with several model chunks per rank, a chunk's virtual stage is told by the
shade (chunk // pp: round-robin and zbv's V alike put chunks pp.. 2pp-1 in the second).
The halves are backward's colour darker (I) and paler (W), so a zero-bubble timeline
reads as a 1F1B one whose backwards were cut in two. White is idle.
"""

from __future__ import annotations

import colorsys
from dataclasses import dataclass, field

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import to_rgb
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from interleaf.protos.actions import CATEGORIES, COMPUTE, Action

COMPUTE_KINDS = ("forward", "backward", "input-grad", "weight-grad", "update", "wait")
MICROBATCH_KINDS = ("forward", "backward", "input-grad", "weight-grad")
"""The computes of one (chunk, microbatch): labelled and shaded by chunk."""
COLOURS = {
    "forward": "#3b75af",
    "backward": "#e1812c",
    "input-grad": "#b5520f",
    "weight-grad": "#f2c14e",
    "update": "#7b5fb0",
    "wait": "#d0d0d0",
    "send": "#3a923a",
    "recv": "#3a923a",
    "exchange": "#3a923a",
    "collective": "#8c564b",
    "zero": "#d6589f",
}
LEGEND = {
    "forward": "forward",
    "backward": "backward",
    "input-grad": "input gradient I",
    "weight-grad": "weight gradient W",
    "update": "weight update",
    "wait": "compute waiting for its inputs",
    "p2p": "send / receive / exchange",
    "collective": "all-reduce (DP, tied embedding)",
    "zero": "ZeRO gather / release / reduce-scatter",
}
DPI = 100
WIDTH_IN = 14.0
ROW_IN = 0.42
PANEL_EXTRA_IN = 1.15
LEGEND_IN = 0.55


@dataclass(frozen=True)
class Bar:
    start: float
    end: float
    kind: str
    """forward, backward, input-grad, weight-grad, update, wait (upper lane); send, recv,
    exchange, collective, zero (lower lane)."""
    label: str = ""
    """What the bar shows when wide enough: the microbatch number of a forward, a
    backward or either half of one."""
    shade: int = 0
    """The virtual stage of such a compute's chunk (chunk // pp): later ones lighter."""


@dataclass
class Panel:
    title: str
    rows: list[tuple[str, list[Bar]]] = field(default_factory=list)
    """(rank label, its bars), top row first."""


def bar_of(action: Action, kind: str, start: float, end: float, pp: int) -> Bar:
    """One action's bar; `kind` is CATEGORIES[action.kind], or "wait"."""
    computes = action.kind in COMPUTE and kind != "wait"
    return Bar(start, end, kind, str(action.microbatch) if computes else "",
               action.chunk // pp if computes else 0)


def sim_bars(spans, pp: int) -> list[Bar]:
    """A simulated rank's spans (coordinator/schedule/simulate.py's Span) as bars."""
    return [bar_of(s.action, CATEGORIES[s.action.kind], s.start, s.end, pp) for s in spans]


def figure(panels: list[Panel], time_label: str, title: str = "", shades: int = 1) -> Figure:
    """The picture of `panels`, one above the other, on one time axis from 0."""
    heights = [len(p.rows) * ROW_IN + PANEL_EXTRA_IN for p in panels]
    fig = Figure(figsize=(WIDTH_IN, sum(heights) + (0.5 if title else 0.1) + LEGEND_IN), dpi=DPI)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    end = max((b.end for p in panels for _, bars in p.rows for b in bars), default=1.0) or 1.0
    kinds = set()
    for ax, panel in zip(axes, panels):
        ax.set_xlim(0, end * 1.005)
        kinds |= _draw(ax, panel, end, shades)
    axes[-1].set_xlabel(time_label)
    if title:
        fig.suptitle(title, fontsize=12)
    handles = _legend(kinds, shades)
    fig.legend(handles=handles, loc="lower center", ncol=min(len(handles), 5), fontsize=9, frameon=False)
    fig.tight_layout(rect=(0, LEGEND_IN / fig.get_figheight(), 1, 1))
    return fig


def write(path: str, panels: list[Panel], time_label: str, title: str = "", shades: int = 1) -> Figure:
    return save(path, figure(panels, time_label, title, shades))


def save(path: str, fig: Figure) -> Figure:
    fig.savefig(path, dpi=DPI)
    return fig


def _draw(ax, panel: Panel, end: float, shades: int) -> set[str]:
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_ylim(len(panel.rows) - 0.5, -0.5)
    ax.set_yticks(range(len(panel.rows)), [label for label, _ in panel.rows], fontsize=9)
    ax.grid(axis="x", color="#eeeeee", linewidth=0.6)
    ax.set_axisbelow(True)
    # Bars narrower than a pixel would vanish; communication's are often far narrower.
    pixel = end / (WIDTH_IN * DPI * 0.85)
    kinds = set()
    for row, (_, bars) in enumerate(panel.rows):
        for bar in bars:
            upper = bar.kind in COMPUTE_KINDS
            y, height = (row - 0.4, 0.56) if upper else (row + 0.2, 0.2)
            width = max(bar.end - bar.start, pixel)
            colour = _colour(bar.kind, bar.shade, shades)
            ax.add_patch(_rect(bar.start, y, width, height, colour, bar.kind == "wait"))
            kinds.add(bar.kind)
            if bar.label and width >= 9 * pixel:
                ax.text(bar.start + width / 2, y + height / 2, bar.label, ha="center", va="center",
                        fontsize=7, color=_ink(colour), clip_on=True)
    return kinds


def _rect(x, y, width, height, colour, hatched):
    return Rectangle((x, y), width, height, facecolor=colour, edgecolor="#909090" if hatched else colour,
                     linewidth=0.3, hatch="////" if hatched else None)


def _colour(kind: str, shade: int, shades: int):
    """The kind's colour; a later virtual stage's forward or backward lighter."""
    r, g, b = to_rgb(COLOURS[kind])
    if shade == 0 or shades <= 1:
        return (r, g, b)
    h, l, s = colorsys.rgb_to_hls(r, g, b)
    return colorsys.hls_to_rgb(h, l + (0.85 - l) * shade / shades, s)


def _ink(colour) -> str:
    """White on dark bars, black on light ones (a later virtual stage's, W's yellow)."""
    return "white" if colorsys.rgb_to_hls(*colour)[1] < 0.6 else "black"


def _legend(kinds: set[str], shades: int) -> list[Patch]:
    handles = []
    for kind in MICROBATCH_KINDS:
        if kind in kinds:
            for shade in range(shades):
                label = LEGEND[kind] + (f" (virtual stage {shade})" if shades > 1 else "")
                handles.append(Patch(facecolor=_colour(kind, shade, shades), label=label))
    for key, members in (("update", {"update"}), ("wait", {"wait"}), ("p2p", {"send", "recv", "exchange"}),
                         ("collective", {"collective"}), ("zero", {"zero"})):
        if kinds & members:
            kind = next(iter(members))
            handles.append(Patch(facecolor=_colour(kind, 0, 1), label=LEGEND[key],
                                 hatch="////" if kind == "wait" else None, edgecolor="#909090"))
    return handles
