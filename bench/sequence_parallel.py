"""Sequence parallelism and the PTD-P scatter/gather at tp=2, against the memory model.

One layout, tp=2 and pp=2 (1F1B, 8 microbatches), run four ways: plain tensor
parallelism (every tensor rank sends its whole copy of each activation and gradient),
scatter/gather (each sends its half, the receiving stage all-gathers), sequence
parallelism (the residual stream split along the sequence; sends carry each rank's
half), and sequence parallelism with scatter/gather on too (which changes nothing: the
sends are halves already). For each, per pipeline rank (tensor rank 0; its partner holds
the same): the activation peak of the server's ledger and the bytes it sent to the
other stage in a traced step, beside the memory model's predictions
(coordinator/memory_model.py), the bytes its tensor group moved, and the step time
against the plain run's. All four must train the same run: losses within 1e-5 of the
plain run's (scatter/gather's bit for bit).

    python bench/sequence_parallel.py [--arch gpt2|llama] [--steps 8] [--warmup 2] [--steps-per-call 2] [--out PATH]
"""

from __future__ import annotations

import statistics

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.coordinator.grid import RankGrid
from interleaf.coordinator.memory_model import predict, sent_bytes_per_step
from interleaf.coordinator.plan import plan_programs

# Siblings in bench/ (the script's own directory is first on sys.path).
from interleaf_run import run_job
from measure import LOSS_TOLERANCE, arguments, machine, max_relative_difference, steady, table, write_json
from workload import MODELS

MODES = {
    "plain": ["parallel.scatter_gather=false"],
    "scatter/gather": ["parallel.scatter_gather=true"],
    "sequence parallel": ["parallel.sequence_parallel=true", "parallel.scatter_gather=false"],
    "sequence parallel + s/g": ["parallel.sequence_parallel=true", "parallel.scatter_gather=true"],
}


def overrides(arch: str, steps: int, warmup: int, mode: str) -> list[str]:
    return MODELS[arch] + [
        "parallel.dp=1", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
        "parallel.microbatches=8", "train.global_batch=16", f"train.steps={steps}",
        f"trace.steps=[{warmup}]",  # the first steady step: its reports carry each rank's traffic
    ] + MODES[mode]


def run_mode(client, sets: list[str], warmup: int) -> dict:
    config = load_config("", sets)
    p = config.parallel
    grid = RankGrid(p.dp, p.pp, p.tp)
    ours = run_job(client, sets)
    programs, _ = plan_programs(config)
    predicted = predict(config, programs)
    traced = {r.rank: r for r in client.trace(ours["job_id"], warmup).reports}
    last = {m["rank"]: m for m in ours["memory"][-1]}
    stages = []
    for stage in range(p.pp):
        rank = next(r for r in range(grid.world_size) if grid.coord(r).pp == stage and grid.coord(r).tp == 0)
        comm = {(c.op, c.group): c.bytes for c in traced[rank].comm}
        stages.append({
            "pipeline_rank": stage, "rank": rank,
            "activations_peak_bytes": last[rank]["activations_peak_bytes"],
            "activations_peak_predicted": predicted[stage]["activations_peak_bytes"],
            "communication_peak_bytes": last[rank]["communication_peak_bytes"],
            "communication_peak_predicted": predicted[stage]["communication_peak_bytes"],
            "p2p_sent_bytes": comm.get(("send", "pp"), 0),
            "p2p_sent_predicted": sent_bytes_per_step(config, programs[stage]),
            "tp_bytes": sum(n for (op, group), n in comm.items() if group == "tp"),
        })
    return {"overrides": sets, "losses": ours["losses"], "step_seconds": ours["step_seconds"],
            "median_step_seconds": statistics.median(steady(ours["step_seconds"], warmup)),
            "stages": stages}


def _kib(n: int) -> str:
    return f"{n / 1024:.1f}"


def main() -> None:
    args = arguments(__doc__.splitlines()[0], "sequence_parallel")
    before = machine()
    cluster = LocalCluster(4, threads_per_server=1, steps_per_call=args.steps_per_call)
    results = {}
    try:
        cluster.start()
        client = cluster.client()
        try:
            for mode in MODES:
                results[mode] = run_mode(client, overrides(args.arch, args.steps, args.warmup, mode), args.warmup)
        finally:
            client.close()
    finally:
        cluster.stop()
    after = machine()

    plain = results["plain"]
    rows = []
    for mode, r in results.items():
        r["step_time_ratio"] = r["median_step_seconds"] / plain["median_step_seconds"]
        r["max_relative_loss_difference"] = max_relative_difference(r["losses"], plain["losses"])
        for s in r["stages"]:
            rows.append([mode if s["pipeline_rank"] == 0 else "", str(s["pipeline_rank"]),
                         f"{_kib(s['activations_peak_bytes'])} / {_kib(s['activations_peak_predicted'])}",
                         f"{_kib(s['p2p_sent_bytes'])} / {_kib(s['p2p_sent_predicted'])}",
                         f"{_kib(s['communication_peak_bytes'])} / {_kib(s['communication_peak_predicted'])}",
                         _kib(s["tp_bytes"]),
                         f"{r['median_step_seconds']:.3f}" if s["pipeline_rank"] == 0 else "",
                         f"{r['step_time_ratio']:.2f}" if s["pipeline_rank"] == 0 else "",
                         f"{r['max_relative_loss_difference']:.1e}" if s["pipeline_rank"] == 0 else ""])
    print(table(["tp=2 pp=2", "pp rank", "activ. peak KiB (meas/pred)", "p2p sent KiB/step (meas/pred)",
                 "comm peak KiB (meas/pred)", "tp group KiB/step", "s/step", "vs plain", "loss rel. diff"], rows))
    print(f"{args.arch}; {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out; "
          f"figures of tensor rank 0 of each pipeline rank")
    write_json(args.out, {
        "benchmark": "sequence_parallel", "arch": args.arch,
        "machine_before": before, "machine_after": after,
        "steps": args.steps, "warmup": args.warmup, "steps_per_call": args.steps_per_call,
        "threads_per_process": 1, "results": results,
    })
    print(f"results written to {args.out}")
    wrong = [f"{mode}: losses {r['max_relative_loss_difference']:.2e} from plain's"
             for mode, r in results.items() if r["max_relative_loss_difference"] > LOSS_TOLERANCE]
    if results["scatter/gather"]["losses"] != plain["losses"]:
        wrong.append("scatter/gather: losses not bit for bit plain's")
    wrong += [f"{mode}, pipeline rank {s['pipeline_rank']}: sent {s['p2p_sent_bytes']} bytes, predicted "
              f"{s['p2p_sent_predicted']}" for mode, r in results.items() for s in r["stages"]
              if s["p2p_sent_bytes"] != s["p2p_sent_predicted"]]
    if wrong:
        raise SystemExit("sequence parallelism / scatter/gather fell short:\n  " + "\n  ".join(wrong))


if __name__ == "__main__":
    main()
