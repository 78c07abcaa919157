"""Data-parallel gradient reduction overlapped with the backward, against torch DDP.

Interleaf cuts each chunk's gradient into buckets (parallel.bucket_mb) and, under
parallel.overlap_grad_reduce, starts each bucket's all-reduce inside the last backward as
soon as the backward has written it, as DDP does with its own buckets. Runs, at dp=2
(pp=1, tp=1, ZeRO-0, 1f1b, 4 microbatches, global batch 16), on the same model, batch,
weights and samples:

  interleaf  bucket_mb=B, overlap on         vs  DDP bucket_cap_mb=B
  interleaf  bucket_mb=B, overlap off        vs  DDP bucket_cap_mb=B
  interleaf  defaults (25 MiB, overlap on)   vs  DDP defaults (25 MiB, first bucket 1 MiB)

and reads each Interleaf job's traced last step: how many bucket reductions started
inside the last backward, and what share of their time in flight fell inside its span
(which also holds the backward's waits for them: each bucket waits for the one before).
It reports step-time ratios per round and their median, Interleaf's overlap on over off,
and loss agreement, and exits non-zero when the two sides' losses differ beyond
measure.LOSS_TOLERANCE.

Each Interleaf job runs on a fresh cluster of 2 one-thread stage servers and each peer
run on a fresh world of 2 one-thread processes, one after the other; every round runs
them all again (a shared machine drifts from one run to the next).

    python bench/grad_overlap.py [--arch gpt2|llama] [--bucket-mb 4] [--rounds 3] [--steps 8] [--warmup 2]
                                 [--out PATH]
"""

from __future__ import annotations

import statistics

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.protos.actions import REDUCTION, Kind, parse

# Siblings in bench/ (the script's own directory is first on sys.path).
import torch_ddp
from interleaf_run import run_job
from measure import arguments, compare, fail_on_loss_disagreement, machine, slowest_rank, table, write_json
from peer_world import PeerWorld
from workload import MODELS

DP = 2


def overrides(arch: str, steps: int, bucket: list[str]) -> list[str]:
    return MODELS[arch] + [
        f"parallel.dp={DP}", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
        "parallel.microbatches=4", "parallel.zero=0", "train.global_batch=16", f"train.steps={steps}",
    ] + bucket


def overlap_in_trace(trace) -> dict:
    """Per rank of a traced step: the bucket reductions (their count, how many started
    inside the chunk's last backward) and the share of their seconds in flight that
    fell inside that backward's span (its waits for them included)."""
    ranks = []
    for report in trace.reports:
        backwards = [s for s in report.spans if s.kind == "backward"]
        last = max(backwards, key=lambda s: parse(s.action).microbatch)
        assert parse(last.action).kind is Kind.BACKWARD
        reductions = [s for s in report.spans if s.kind == REDUCTION]
        flight = sum(s.end_seconds - s.start_seconds for s in reductions)
        hidden = sum(max(0.0, min(s.end_seconds, last.end_seconds) - max(s.start_seconds, last.start_seconds))
                     for s in reductions)
        ranks.append({"rank": report.rank, "buckets": len(reductions),
                      "started_inside_last_backward": sum(last.start_seconds < s.start_seconds < last.end_seconds
                                                          for s in reductions),
                      "last_backward_seconds": last.end_seconds - last.start_seconds,
                      "in_flight_seconds": flight, "hidden_share": hidden / flight if flight else 0.0})
    return {"step": trace.step, "ranks": ranks}


def run_interleaf(sets: list[str], args) -> tuple[dict, dict]:
    with LocalCluster(DP, threads_per_server=1, steps_per_call=args.steps_per_call) as cluster:
        client = cluster.client()
        try:
            ours = run_job(client, sets)
            return ours, overlap_in_trace(client.trace(ours["job_id"]))
        finally:
            client.close()


def run_ddp(sets: list[str], bucket_cap_mb: float | None) -> tuple[list[float], list[float]]:
    with PeerWorld(DP) as peers:
        per_rank = peers.run(torch_ddp.train, load_config("", sets), bucket_cap_mb)
    # Replicas hold equal rows, so the step's loss is the mean of theirs.
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in per_rank))]
    return slowest_rank([r["step_seconds"] for r in per_rank]), losses


def main() -> None:
    def options(parser):
        parser.add_argument("--bucket-mb", type=float, default=4.0,
                            help="bucket size of the first two pairs, both sides (MiB)")
        parser.add_argument("--rounds", type=int, default=3,
                            help="rounds of every run, one after the other: the machine drifts between runs")

    args = arguments(__doc__.splitlines()[0], "grad_overlap", options)
    b = args.bucket_mb
    runs = [  # (label, Interleaf's settings, DDP's bucket_cap_mb)
        (f"bucket {b:g} MiB, overlap on vs DDP", [f"parallel.bucket_mb={b}"], b),
        (f"bucket {b:g} MiB, overlap off vs DDP", [f"parallel.bucket_mb={b}", "parallel.overlap_grad_reduce=false"], b),
        ("defaults vs DDP defaults", [], None),
    ]
    before = machine()
    rounds: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    for _ in range(args.rounds):
        peers = {cap: run_ddp(overrides(args.arch, args.steps, []), cap) for cap in (b, None)}
        for label, bucket, cap in runs:
            sets = overrides(args.arch, args.steps, bucket)
            ours, overlap = run_interleaf(sets, args)
            result = compare(ours, *peers[cap], args.warmup, (DP, DP))
            rounds[label].append({"overrides": sets, "ddp_bucket_cap_mb": cap, "traced_overlap": overlap, **result})
    after = machine()

    medians = {label: statistics.median(r["ratio"] for r in results) for label, results in rounds.items()}
    on, off = (rounds[label] for label, _, _ in runs[:2])
    own = [a["interleaf_step_seconds"] / o["interleaf_step_seconds"] for a, o in zip(on, off)]
    print(table(["", *(f"round {i + 1}" for i in range(args.rounds)), "median ratio"], [
        [label, *(f"{r['interleaf_step_seconds']:.3f} / {r['peer_step_seconds']:.3f} = {r['ratio']:.2f}"
                  for r in results), f"{medians[label]:.2f}"] for label, results in rounds.items()]
        + [["overlap on / off (Interleaf alone)", *(f"{x:.2f}" for x in own), f"{statistics.median(own):.2f}"]]))
    print()
    for label, results in rounds.items():
        for i, r in enumerate(results):
            for rank in r["traced_overlap"]["ranks"]:
                print(f"{label}, round {i + 1}, rank {rank['rank']}: {rank['buckets']} bucket reductions, "
                      f"{rank['started_inside_last_backward']} started inside the last backward "
                      f"({rank['last_backward_seconds'] * 1e3:.0f} ms), {rank['hidden_share']:.0%} of their "
                      f"{rank['in_flight_seconds'] * 1e3:.0f} ms in flight inside its span")
    print(f"{args.arch}; {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out; "
          f"cells: Interleaf s/step / DDP s/step = ratio (medians of the run's steady steps)")
    write_json(args.out, {
        "benchmark": "grad_overlap", "arch": args.arch, "dp": DP, "bucket_mb": b, "rounds": args.rounds,
        "machine_before": before, "machine_after": after, "steps": args.steps, "warmup": args.warmup,
        "steps_per_call": args.steps_per_call, "threads_per_process": 1,
        "median_ratios": medians, "overlap_on_over_off": own, "results": rounds,
    })
    print(f"results written to {args.out}")
    fail_on_loss_disagreement([(f"{label}, round {i + 1}", r) for label, results in rounds.items()
                               for i, r in enumerate(results)])


if __name__ == "__main__":
    main()
