"""The timeline as a text table and as a PNG written without an imaging library."""

from __future__ import annotations

import re
import struct
import zlib

import numpy as np

from interleaf.coordinator.schedule import CostModel, build_programs, simulate, timeline_table, write_png
from interleaf.coordinator.schedule.render import encode_png

UNIFORM = CostModel(forward_s=1.0, backward_s=1.0)


def _chunks(data: bytes) -> list[tuple[bytes, bytes]]:
    """Splits a PNG into (type, payload), checking each chunk's CRC on the way."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(data):
        (length,) = struct.unpack(">I", data[at:at + 4])
        kind, payload = data[at + 4:at + 8], data[at + 8:at + 8 + length]
        (crc,) = struct.unpack(">I", data[at + 8 + length:at + 12 + length])
        assert crc == zlib.crc32(kind + payload) & 0xFFFFFFFF
        chunks.append((kind, payload))
        at += 12 + length
    return chunks


def _decode(data: bytes) -> np.ndarray:
    chunks = _chunks(data)
    assert [k for k, _ in chunks] == [b"IHDR", b"IDAT", b"IEND"]
    width, height, depth, colour, _, _, _ = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, colour) == (8, 2)
    raw = zlib.decompress(chunks[1][1])
    assert len(raw) == height * (1 + 3 * width)
    rows = np.frombuffer(raw, np.uint8).reshape(height, 1 + 3 * width)
    assert not rows[:, 0].any()  # filter type 0 on every row
    return rows[:, 1:].reshape(height, width, 3)


def test_table_places_each_action_in_its_slot():
    programs = build_programs("gpipe", 2, 1, 2, dp=1)
    table = timeline_table(programs, simulate(programs, UNIFORM))
    assert table.splitlines() == [
        "slot    0    1    2    3    4    5",
        "rank 0  F0.0 F0.1 .    .    B0.0 B0.1",
        "rank 1  .    F1.0 F1.1 B1.0 B1.1 .",
        "bubble fraction 0.3333 (makespan 6 s)",
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
    assert lines[-1] == f"bubble fraction {3 / 19:.4f} (makespan {columns} s)"


def test_longer_backwards_span_several_slots():
    programs = build_programs("1f1b", 1, 1, 2, dp=1)
    table = timeline_table(programs, simulate(programs, CostModel(1.0, 2.0)))
    assert table.splitlines()[1] == "rank 0  F0.0 B0.0 -    F0.1 B0.1 -"


def test_png_has_matching_header_and_pixels(tmp_path):
    programs = build_programs("gpipe", 2, 1, 2, dp=1)
    result = simulate(programs, UNIFORM)
    path = tmp_path / "timeline.png"
    write_png(str(path), programs, result)
    data = path.read_bytes()
    width, height = struct.unpack(">II", _chunks(data)[0][1][:8])
    image = _decode(data)
    assert image.shape == (height, width, 3)
    slot, band = width // 6, height // 2  # six slots; two rank bands

    def middle(rank: int, column: int) -> np.ndarray:
        return image[rank * band + band // 2 - 1, column * slot + slot // 2]

    white = [255, 255, 255]
    assert middle(1, 0).tolist() == white        # rank 1 idles in slot 0
    forward, backward = middle(0, 0), middle(0, 4)  # F0.0 and B0.0, same microbatch
    assert forward.tolist() != white and backward.tolist() != white
    assert int(forward.sum()) > int(backward.sum())  # forwards drawn lighter
    assert middle(0, 1).tolist() != forward.tolist()  # microbatch 1 has another hue
    border = image[0, 0]  # a box's 1px border is darker than its fill
    assert int(border.sum()) < int(forward.sum())


def test_encoder_round_trips_an_array():
    rgb = np.arange(2 * 3 * 3, dtype=np.uint8).reshape(2, 3, 3)
    assert np.array_equal(_decode(encode_png(rgb)), rgb)
