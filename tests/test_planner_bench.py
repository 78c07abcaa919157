"""bench/planner.py runs end to end on a tiny model: the profile is measured on its two
servers, every layout of the grid and the planner's pick run and train the same run, and
each has a prediction beside its measurement. (Its figures mean nothing at this size:
docs/benchmarks.md has the real run's.)"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_planner_bench_tiny_runs(tmp_path):
    out = tmp_path / "planner.json"
    result = subprocess.run([sys.executable, "bench/planner.py", "--tiny", "--out", str(out)],
                            capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert sum(r["in_grid"] for r in runs) == 4 and sum(r["planned"] for r in runs) == 1
    assert data["summary"]["losses_disagree"] == []
    for run in runs:
        assert run["measured_step_s"] > 0 and run["predicted_step_s"] > 0
        assert len(run["round_medians_s"]) == 3
        assert run["measured_peak_bytes"] > 0 and run["predicted_peak_bytes"] > 0
    # the pick is the least predicted step of every candidate, the grid's among them
    planned = next(r for r in runs if r["planned"])
    # the plan, the grid's best and the default play one more round (three in a real run)
    finalists = [r for r in runs if r["playoff_medians_s"]]
    assert planned in finalists and all(len(r["playoff_medians_s"]) == 1 for r in finalists)
    assert data["summary"]["planned_step_s"] == min(planned["round_medians_s"] + planned["playoff_medians_s"])
    assert planned["predicted_step_s"] <= min(r["predicted_step_s"] for r in runs) * 1.01
    assert len(data["profile"]["observations"]) > 0
    # the planned layout's chunk shapes were timed on the servers before it was chosen
    from interleaf.clients import plan_profile
    from interleaf.coordinator.config import load_config
    from interleaf.coordinator.planner.costs import DeviceProfile

    profile = DeviceProfile.from_json(data["profile"])
    config = load_config("", data["model"] + [f"train.global_batch={data['global_batch']}"]
                         + [s for s in planned["settings"] if s != "--set"])
    assert plan_profile.untimed_shapes([config], profile) == []
    # bench/planner_repredict.py rebuilds each layout's prediction from the JSON alone
    # (the profile, the model, the settings, the machine's cores): the same as the run's
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from planner_repredict import repredicted
    finally:
        sys.path.remove(str(REPO / "bench"))
    rows = repredicted(data)
    assert [row["layout"] for row in rows] == [r["layout"] for r in runs if r["in_grid"]]
    for row in rows:
        assert abs(row["predicted_s"] - row["reported_s"]) <= 1e-9 * row["reported_s"], row
    # a run from before the JSON recorded its compute slowdown: rebuilt from its cores alike
    unrecorded = {k: v for k, v in data.items() if k != "compute_slowdown"}
    assert [row["predicted_s"] for row in repredicted(unrecorded)] == [row["predicted_s"] for row in rows]
