"""Draws a simulated step: a text table for logs and terminals, and a PNG.

Both place each compute action at its simulated start time. The time slot is the
shortest compute duration, so with a uniform cost model (forward_s == backward_s) every
action fills exactly one column; otherwise longer actions span several columns and
starts are rounded to the nearest slot. Only forwards and backwards are drawn; the rest
of the time shows as idle, which is what the bubble fraction counts.
"""

from __future__ import annotations

import colorsys
import math
import struct
import zlib

import numpy as np

from interleaf.protos.actions import COMPUTE, Action, Kind
from .simulate import SimResult, Span

_IDLE, _CONTINUED = ".", "-"
_PX_PER_SLOT, _BAND_PX, _GAP_PX = 12, 16, 2


def timeline_table(programs: list[list[Action]], result: SimResult) -> str:
    """One row per rank, one column per time slot; gpipe, pp=2, m=2, uniform costs:

        slot    0    1    2    3    4    5
        rank 0  F0.0 F0.1 .    .    B0.0 B0.1
        rank 1  .    F1.0 F1.1 B1.0 B1.1 .
        bubble fraction 0.3333 (makespan 6 s)

    A "-" continues the action to its left (a backward costing two forwards).
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
    lines.append(f"bubble fraction {result.bubble_fraction:.4f} "
                 f"(makespan {result.makespan_s:g} s)")
    return "\n".join(line.rstrip() for line in lines)


def write_png(path: str, programs: list[list[Action]], result: SimResult) -> None:
    """Draws one band per rank: a box per compute action, hue by microbatch, forwards
    light and backwards dark, a darker 1px border around each box, idle time white."""
    spans = _compute_spans(programs, result)
    slot = _slot_s(spans) or 1.0
    microbatches = 1 + max((a.microbatch for p in programs for a in p if a.kind in COMPUTE),
                           default=0)
    width = max(1, math.ceil(result.makespan_s / slot * _PX_PER_SLOT))
    height = max(1, len(programs) * (_BAND_PX + _GAP_PX) - _GAP_PX)
    image = np.full((height, width, 3), 255, dtype=np.uint8)
    for rank, rank_spans in enumerate(spans):
        top = rank * (_BAND_PX + _GAP_PX)
        for span in rank_spans:
            x0 = round(span.start / slot * _PX_PER_SLOT)
            x1 = max(x0 + 1, round(span.end / slot * _PX_PER_SLOT))
            fill = _colour(span.action, microbatches)
            box = image[top:top + _BAND_PX, x0:x1]
            box[:] = (fill * 0.6).astype(np.uint8)
            box[1:-1, 1:-1] = fill
    with open(path, "wb") as f:
        f.write(encode_png(image))


def encode_png(rgb: np.ndarray) -> bytes:
    """A minimal 8-bit RGB PNG (RFC 2083): IHDR, one zlib-compressed IDAT in which each
    row starts with filter byte 0 (none), IEND; each chunk carries its CRC-32."""
    height, width, _ = rgb.shape
    rows = np.concatenate([np.zeros((height, 1), np.uint8),
                           rgb.astype(np.uint8).reshape(height, width * 3)], axis=1)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(rows.tobytes())) + chunk(b"IEND", b""))


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


def _colour(action: Action, microbatches: int) -> np.ndarray:
    saturation, value = (0.35, 1.0) if action.kind is Kind.FORWARD else (0.8, 0.8)
    rgb = colorsys.hsv_to_rgb(action.microbatch / microbatches, saturation, value)
    return np.array([round(255 * c) for c in rgb], dtype=np.uint8)
