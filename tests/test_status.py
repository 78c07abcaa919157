"""The rank-to-coordinate map and group membership, in job status and in
`interleaf schedule`."""

from __future__ import annotations

import subprocess
import sys

from interleaf.coordinator.grid import RankGrid
from tests.conftest import TINY, run_job

LAYOUT = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2"]


def test_status_reports_coordinates_groups_and_layout(client):
    final, steps = run_job(client, TINY + LAYOUT)
    assert final.state == "SUCCEEDED", final.error
    assert (final.step, final.steps, len(steps)) == (3, 3, 3)
    grid = RankGrid(2, 2, 2)
    assert [r.rank for r in final.ranks] == list(range(8))
    for info in final.ranks:
        c = grid.coord(info.rank)
        assert (info.coordinates.dp, info.coordinates.pp, info.coordinates.tp) == (c.dp, c.pp, c.tp)
        assert list(info.chunks) == [c.pp, c.pp + 2]
    assert {g.name: list(g.members) for g in final.groups} == grid.all_groups()
    addresses = {r.server_address for r in final.ranks}
    assert len(addresses) == 8
    assert "pipeline rank 1: chunk 1 [layers 2-3], chunk 3 [layers 6-7 + head]" in final.layout
    assert "simulated bubble fraction (a backward costing two forwards): 0.111" in final.layout


def test_schedule_command_prints_grid_programs_and_bubble(tmp_path):
    png = tmp_path / "t.png"
    args = [a for o in TINY + LAYOUT for a in ("--set", o)]
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "schedule", *args, "--png", str(png)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "   5   1   0   1" in out  # rank 5 -> dp 1, pp 0, tp 1
    assert "tp/d1/p0     [4, 5]" in out and "dp/p0/t1     [1, 5]" in out
    # p=2, v=2, m=4: (p-1)/(v*m+p-1) = 1/9
    assert "bubble fraction 0.1111" in out
    timeline, programs = out.split("programs (every action, in order):")
    assert timeline.count("F0.") == 4 and timeline.count("B3.") == 4
    program_lines = programs.strip().splitlines()[:2]
    assert program_lines[0].startswith("rank 0  F0.0 SA0.0>1") and program_lines[0].endswith("DP0 TIE OPT")
    assert "predicted memory per rank" in programs and "activations peak" in programs
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
