"""The planner's committed CPU benchmark runs predicted again by this tree's cost model.

Each `bench/planner.py` JSON holds the device profile its run measured and every hand
layout's measured step. This prices those layouts again with today's costs and
simulator (costs.layout_costs, search.simulate_layout) on each run's own profile, and
sets the rank correlation and the errors beside the ones the run reported: a change to
the pricing is weighed on every run at once, in seconds, where a new run takes 13
minutes and gives one more sample of a machine whose steps vary by several percent.

It cannot show what a change to the profile's measurement would have measured (the
profiles are as their runs took them), nor move the measured steps.

    python bench/planner_repredict.py [--verbose] [JSON...]   # default: bench/results/planner*.json
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

from interleaf.clients.launcher import threads_per_local_server
from interleaf.clients.plan_command import host_slowdown
from interleaf.coordinator.config import load_config
from interleaf.coordinator.planner.costs import DeviceProfile, layout_costs
from interleaf.coordinator.planner.search import programs_for, simulate_layout

# A sibling in bench/ (the script's own directory is first on sys.path).
from planner import spearman

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def repredicted(run_json: dict) -> list[dict]:
    """Per hand layout of a CPU run: its name, measured step, the run's prediction, and
    today's."""
    slowdown = run_json.get("compute_slowdown")  # recorded since 2026-11-28
    if slowdown is None:  # the run's LocalCluster gave each server its default threads on the run's machine
        servers, cores = run_json["servers"], run_json["machine_before"]["cpus"]
        slowdown = host_slowdown(servers, threads_per_local_server(servers, cores), cores)
    profile = DeviceProfile.from_json(run_json["profile"])
    base = [*run_json["model"], f"train.global_batch={run_json['global_batch']}",
            f"train.steps={run_json['steps']}", "checkpoint.every=0"]
    rows = []
    for run in run_json["runs"]:
        if not run["in_grid"]:
            continue
        job = load_config("", base + run["settings"])
        today = simulate_layout(job, programs_for(job), layout_costs(job, profile, slowdown)).makespan_s
        rows.append({"layout": run["layout"], "measured_s": run["measured_step_s"],
                     "reported_s": run["predicted_step_s"], "predicted_s": today})
    return rows


def summary(rows: list[dict], predicted: str) -> tuple[float, float, float]:
    """(Spearman, median |error|, the error of largest size) of `predicted` against the
    measured steps."""
    errors = [row[predicted] / row["measured_s"] - 1 for row in rows]
    rho = spearman([row[predicted] for row in rows], [row["measured_s"] for row in rows])
    return rho, statistics.median(abs(e) for e in errors), max(errors, key=abs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=pathlib.Path, help="planner JSONs (default: the committed ones)")
    parser.add_argument("--verbose", action="store_true", help="every layout's errors too")
    args = parser.parse_args(argv)
    files = args.files or sorted(RESULTS.glob("planner*.json"))
    print(f"{'run':<28} {'Spearman':>17} {'median |error|':>17} {'worst error':>17}")
    print(f"{'':<28} {'reported  today':>17} {'reported  today':>17} {'reported  today':>17}")
    for path in files:
        run_json = json.loads(path.read_text())
        if run_json.get("device") != "cpu":
            continue
        rows = repredicted(run_json)
        (rho0, med0, worst0), (rho1, med1, worst1) = summary(rows, "reported_s"), summary(rows, "predicted_s")
        print(f"{path.stem:<28} {rho0:8.3f} {rho1:7.3f} {med0:8.1%} {med1:7.1%} {worst0:+8.1%} {worst1:+7.1%}")
        if args.verbose:
            for row in rows:
                print(f"    {row['layout']:<44} measured {row['measured_s']:.3f} s, error "
                      f"{row['reported_s'] / row['measured_s'] - 1:+.1%} reported, "
                      f"{row['predicted_s'] / row['measured_s'] - 1:+.1%} today")
    return 0


if __name__ == "__main__":
    sys.exit(main())
