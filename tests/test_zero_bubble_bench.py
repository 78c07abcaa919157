"""bench/zero_bubble.py runs end to end on a tiny model: every Interleaf schedule and
every torch peer trains the same run, the split's cost is read from the traces, and the
peers' activation peaks are counted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_zero_bubble_bench_tiny_runs(tmp_path):
    out = tmp_path / "zero_bubble.json"
    result = subprocess.run([sys.executable, "bench/zero_bubble.py", "--tiny", "--out", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())

    ours = data["interleaf"]
    assert set(ours) == {"1f1b", "zb-h1", "interleaved-1f1b", "zbv"}
    for run in ours.values():  # the same computation, the bench's own check besides
        assert run["loss_difference"] <= 1e-5
        assert all(peak > 0 for peak in run["figures"]["activations_peak_bytes"])
    peers = {(r["schedule"], r["stages_per_rank"]) for r in data["torch"]}
    assert peers == {("1F1B", 1), ("InterleavedZeroBubble", 1), ("Interleaved1F1B", 2),
                     ("InterleavedZeroBubble", 2), ("ZBVZeroBubble", 2)}
    for run in data["torch"]:
        assert run["loss_difference"] <= 1e-5
        assert len(run["figures"]["activations_peak_bytes"]) == 2
        assert all(peak > 0 for peak in run["figures"]["activations_peak_bytes"])

    for label in ("zb-h1 vs 1f1b", "zbv vs interleaved-1f1b"):
        split = data["split"][label]
        assert len(split["chunks"]) == (2 if label.startswith("zb-h1") else 4)
        assert all(min(c["counts"]) > 0 and c["ratio"] > 0 for c in split["chunks"].values())

    # torch splits Interleaf's own Functions correctly, running a weight's one twice.
    check = data["torch_split_check"]
    assert check["bitwise_equal"]
    assert check["split"]["_LinearAllReduce"] == {"input_half": 1, "weight_half": 1}
    assert check["split"]["_FusedLinearCrossEntropy"] == {"input_half": 1, "weight_half": 1}
