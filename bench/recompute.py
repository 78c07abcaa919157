"""Activation recompute's trade: peak activation bytes against step time, for
train.recompute = none, selective (and selective with recompute_layers=2) and full, on
one layout: the benchmark workload (workload.py) at pp=2, 1f1b, 8 microbatches of 2
samples, one stage server per rank on a local cluster (one torch thread each); with
`--layout tp2-pp2-sp`, the same at tp=2 with sequence parallelism (4 servers), where
selective replays its gathers and reduce-scatters.

Per mode: each pipeline rank's activation peak (its tensor rank 0's) as its ledger reports it (RankMemory's
activations_peak_bytes, the most a step held at once: what the memory model predicts,
and the figure recompute changes), the memory model's prediction beside it
(coordinator/memory_model.py), and the median step time after warm-up. Recompute
changes what is kept, never what is computed: the script exits non-zero, after writing
its JSON, when any mode's per-step losses differ from recompute=none's beyond
measure.LOSS_TOLERANCE (they are bitwise equal on CPU).

    python bench/recompute.py [--arch gpt2|llama] [--layout pp2|tp2-pp2-sp] [--steps 8] [--warmup 2] [--out PATH]
"""

from __future__ import annotations

import os
import statistics

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.coordinator.grid import Coord, RankGrid
from interleaf.coordinator.memory_model import predict
from interleaf.coordinator.plan import plan_programs

# Siblings in bench/ (the script's own directory is first on sys.path).
from interleaf_run import run_job
from measure import LOSS_TOLERANCE, arguments, machine, max_relative_difference, steady, table, write_json
from workload import MODELS

PIPELINE = ["parallel.dp=1", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
            "parallel.microbatches=8", "train.global_batch=16"]
LAYOUTS = {
    "pp2": PIPELINE + ["parallel.tp=1"],
    "tp2-pp2-sp": PIPELINE + ["parallel.tp=2", "parallel.sequence_parallel=true"],
}
MODES = {
    "none": ["train.recompute=none"],
    "selective": ["train.recompute=selective"],
    "selective, recompute_layers=2": ["train.recompute=selective", "train.recompute_layers=2"],
    "full": ["train.recompute=full"],
}
MIB = 1 << 20


def main() -> None:
    def layout_option(parser):
        parser.add_argument("--layout", choices=sorted(LAYOUTS), default="pp2", help="the layout every mode runs")

    args = arguments("Peak activation bytes and step time of each recompute mode", "recompute", layout_option)
    default_out = os.path.join(os.path.dirname(__file__), "results",
                               "recompute" + ("" if args.arch == "gpt2" else f"-{args.arch}") + ".json")
    if args.layout != "pp2" and args.out == default_out:  # each layout its own results file
        args.out = default_out[:-len(".json")] + f"-{args.layout}.json"
    layout = LAYOUTS[args.layout]
    servers = load_config("", MODELS[args.arch] + layout).parallel.world_size
    before = machine()
    runs = {}
    with LocalCluster(servers, threads_per_server=1, steps_per_call=args.steps_per_call) as cluster:
        client = cluster.client()
        for mode, sets in MODES.items():
            overrides = MODELS[args.arch] + layout + [f"train.steps={args.steps}"] + sets
            config = load_config("", overrides)
            predicted = [p["activations_peak_bytes"] for p in predict(config, plan_programs(config)[0])]
            result = run_job(client, overrides)
            p = config.parallel  # the prediction is per pipeline rank: tensor rank 0 of each stage measures it
            grid = RankGrid(p.dp, p.pp, p.tp)
            ranks = [grid.rank(Coord(0, stage, 0)) for stage in range(p.pp)]
            measured = [max(step[rank]["activations_peak_bytes"] for step in result["memory"][args.warmup:])
                        for rank in ranks]
            runs[mode] = {"overrides": overrides, "predicted_activations_peak_bytes": predicted,
                          "activations_peak_bytes": measured, **result}
        client.close()
    after = machine()

    base = runs["none"]
    rows, differ = [], []
    for mode, run in runs.items():
        seconds = statistics.median(steady(run["step_seconds"], args.warmup))
        drift = max_relative_difference(run["losses"], base["losses"])
        run["median_step_seconds"], run["loss_rel_diff_vs_none"] = seconds, drift
        if drift > LOSS_TOLERANCE:
            differ.append(f"{mode}: losses differ from recompute=none's by {drift:.1e}")
        rows.append([mode, "/".join(f"{b / MIB:.1f}" for b in run["activations_peak_bytes"]),
                     "/".join(f"{b / MIB:.1f}" for b in run["predicted_activations_peak_bytes"]),
                     f"{run['activations_peak_bytes'][0] / base['activations_peak_bytes'][0]:.2f}",
                     f"{seconds:.3f}", f"{seconds / statistics.median(steady(base['step_seconds'], args.warmup)):.2f}",
                     f"{drift:.1e}"])
    print(table(["recompute", "activ. peak MiB (per pp rank)", "predicted MiB", "rank 0 vs none", "s/step",
                 "vs none", "loss rel. diff"], rows))
    print(f"{args.arch}, layout {args.layout}, {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out")
    write_json(args.out, {"benchmark": "recompute", "arch": args.arch, "layout": args.layout, "machine_before": before,
                          "machine_after": after, "runs": runs})
    if differ:
        raise SystemExit("recompute changed the run:\n  " + "\n  ".join(differ))


if __name__ == "__main__":
    main()
