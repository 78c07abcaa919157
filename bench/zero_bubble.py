"""Zero-bubble schedules (zb-h1, zbv) against 1F1B, interleaved 1F1B and torch's
zero-bubble schedules: step time, peak activation bytes, losses, and what splitting a
backward into its input- and weight-gradient halves costs.

pp=2 on two processes with one torch thread each, 8 microbatches, the workload of every
benchmark (workload.py). Each Interleaf job (a local cluster: coordinator + 2 stage
servers) is followed at once by its torch.distributed.pipelining counterpart over gloo:

    Interleaf                       torch
    1f1b              (vpp=1)       Schedule1F1B
    zb-h1             (vpp=1)       ScheduleInterleavedZeroBubble, 1 stage per rank (ZB-H1)
    interleaved-1f1b  (vpp=2)       ScheduleInterleaved1F1B, then ScheduleInterleavedZeroBubble
    zbv               (vpp=2, V)    ScheduleZBVZeroBubble (stages 0, 3 on rank 0; 1, 2 on rank 1)

Every run must train the same run: each one's per-step losses within
measure.LOSS_TOLERANCE of Interleaf's 1f1b (the script exits non-zero after writing its
JSON otherwise). The split's cost is read from Interleaf's executed traces of every
steady step: per chunk, mean(I) + mean(W) of the zero-bubble run over mean(B) of the
fused run with the same chunks (zb-h1 against 1f1b, zbv against interleaved-1f1b).

    python bench/zero_bubble.py [--arch gpt2|llama] [--steps 8] [--warmup 2] [--steps-per-call 2]
                                [--tiny] [--out PATH]

--tiny: a 4-layer model of d_model 32 for 4 steps (1 of warm-up, 1 per block), a check
that everything runs (seconds); its figures mean nothing.
"""

from __future__ import annotations

import statistics

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.coordinator.plan import plan_programs
from interleaf.coordinator.schedule import CostModel, simulate

# Siblings in bench/ (the script's own directory is first on sys.path).
import torch_pipeline
import torch_split
from interleaf_run import run_job
from measure import (LOSS_TOLERANCE, arguments, compare, comparison_table, machine, max_relative_difference,
                     slowest_rank, steady, table, write_json)
from peer_world import PeerWorld
from split_cost import mean_seconds, split_cost, split_table
from workload import MODELS

PP = 2
RUNS = [  # (Interleaf schedule, vpp, torch's schedules run after it on the same layout)
    ("1f1b", 1, ["1F1B"]),
    ("zb-h1", 1, ["InterleavedZeroBubble"]),
    ("interleaved-1f1b", 2, ["Interleaved1F1B", "InterleavedZeroBubble"]),
    ("zbv", 2, ["ZBVZeroBubble"]),
]
SPLIT_PAIRS = [("zb-h1", "1f1b"), ("zbv", "interleaved-1f1b")]  # (split run, fused run with the same chunks)
TINY_MODEL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16",
              "model.vocab_size=256"]
MIB = 1 << 20


def overrides(model: list[str], schedule: str, vpp: int, steps: int, warmup: int) -> list[str]:
    return model + [
        "parallel.dp=1", "parallel.tp=1", f"parallel.pp={PP}", f"parallel.vpp={vpp}",
        f"parallel.schedule={schedule}", "parallel.microbatches=8",
        "train.global_batch=16", f"train.steps={steps}",
        f"trace.steps={list(range(warmup, steps))}",  # every steady step: the split's cost is read from them
    ]


def interleaf_run(client, sets: list[str], warmup: int) -> dict:
    ours = run_job(client, sets)
    steps = len(ours["step_seconds"])
    ours["spans"] = {step: {r.rank: [(s.action, s.kind, s.end_seconds - s.start_seconds) for s in r.spans]
                            for r in client.trace(ours["job_id"], step).reports}
                     for step in range(warmup, steps)}
    return ours


def figures(step_seconds: list[float], warmup: int, activations: list[float], rss: list[float]) -> dict:
    return {"step_seconds": statistics.median(steady(step_seconds, warmup)),
            "best_step_seconds": min(steady(step_seconds, warmup)),
            "activations_peak_bytes": activations, "rss_peak_bytes": rss}


def interleaf_figures(ours: dict, warmup: int) -> dict:
    """figures(), the executed bubble (idle: the median over steady steps of the mean
    over ranks of the time with no compute, over the step) and the simulator's: at the
    planner's default costs (a forward 1, a backward 2, each half 1) and at this run's
    mean measured time per kind of action."""
    memory = ours["memory"][warmup:]
    ranks = range(len(memory[0]))
    idle = [e / s for e, s in zip(steady(ours["idle_seconds"], warmup), steady(ours["step_seconds"], warmup))]
    programs, planned = plan_programs(load_config("", ours["overrides"]))
    measured = mean_seconds(ours["spans"])
    cost = CostModel(forward_s=measured["F"], backward_s=measured.get("B", 0.0), input_s=measured.get("I"),
                     weight_s=measured.get("W"), optimizer_s=measured["OPT"])
    return {**figures(ours["step_seconds"], warmup,
                      [max(step[r]["activations_peak_bytes"] for step in memory) for r in ranks],
                      [max(step[r]["rss_peak_bytes"] for step in memory) for r in ranks]),
            "idle_fraction": statistics.median(idle), "simulated_bubble_planner_costs": planned,
            "simulated_bubble_measured_costs": simulate(programs, cost).bubble_fraction,
            "mean_action_seconds": measured}


def torch_figures(per_rank: list[dict], warmup: int) -> dict:
    return figures(slowest_rank([r["step_seconds"] for r in per_rank]), warmup,
                   [r["activations_peak_bytes"] for r in per_rank],
                   [max(steady(r["rss_peak_bytes"], warmup)) for r in per_rank])


def run_all(client, peers: PeerWorld, model: list[str], steps: int, warmup: int) -> tuple[dict, dict]:
    """Interleaf's runs by schedule, torch's by (name, stages per rank)."""
    ours, theirs = {}, {}
    for schedule, vpp, peers_of in RUNS:
        sets = overrides(model, schedule, vpp, steps, warmup)
        ours[schedule] = {"vpp": vpp, "overrides": sets, **interleaf_run(client, sets, warmup)}
        for peer in peers_of:
            per_rank = peers.run(torch_pipeline.train, load_config("", sets), peer, True)
            losses = next(r["losses"] for r in per_rank if r["losses"] is not None)
            theirs[(peer, vpp)] = {"schedule": peer, "stages_per_rank": vpp, "ranks": per_rank, "losses": losses}
    return ours, theirs


def mib(values: list[int]) -> str:
    return "/".join(f"{v / MIB:.1f}" for v in values)


def runs_table(rows: list[tuple[str, dict, float]]) -> str:
    headers = ["", "s/step (median)", "fastest step", "idle", "simulated: planner / measured costs",
               "activations peak MiB r0/r1", "rss peak MiB r0/r1", "loss rel. diff vs interleaf 1f1b"]
    return table(headers, [
        [label, f"{f['step_seconds']:.3f}", f"{f['best_step_seconds']:.3f}",
         f"{f['idle_fraction']:.1%}" if "idle_fraction" in f else "-",
         f"{f['simulated_bubble_planner_costs']:.1%} / {f['simulated_bubble_measured_costs']:.1%}"
         if "idle_fraction" in f else "-", mib(f["activations_peak_bytes"]),
         mib(f["rss_peak_bytes"]), f"{diff:.1e}" + ("" if diff <= LOSS_TOLERANCE else " DIFFER")]
        for label, f, diff in rows])


def main() -> None:
    def tiny_option(parser):
        parser.add_argument("--tiny", action="store_true",
                            help="a 4-layer d_model 32 model, 4 steps, 1 of warm-up: a check that it runs")

    args = arguments(__doc__.splitlines()[0], "zero_bubble", tiny_option)
    model = TINY_MODEL if args.tiny else MODELS[args.arch]
    if args.tiny:
        args.steps, args.warmup, args.steps_per_call = 4, 1, 1

    split_check = torch_split.check()
    before = machine()
    cluster, peers = LocalCluster(PP, threads_per_server=1, steps_per_call=args.steps_per_call), PeerWorld(PP)
    try:
        cluster.start()
        peers.start()
        client = cluster.client()
        try:
            ours, theirs = run_all(client, peers, model, args.steps, args.warmup)
        finally:
            client.close()
    finally:
        peers.close()
        cluster.stop()
    after = machine()

    split = {f"{zb} vs {fused}": split_cost(ours[zb]["spans"], ours[fused]["spans"]) for zb, fused in SPLIT_PAIRS}
    reference = ours["1f1b"]["losses"]
    rows, labelled = [], []
    for schedule, vpp, peers_of in RUNS:
        ours[schedule]["figures"] = interleaf_figures(ours[schedule], args.warmup)
        ours[schedule]["loss_difference"] = max_relative_difference(ours[schedule]["losses"], reference)
        ours[schedule]["losses_bitwise_equal_1f1b"] = ours[schedule]["losses"] == reference
        rows.append((f"interleaf {schedule}" + (f" (vpp={vpp})" if vpp > 1 else ""), ours[schedule]["figures"],
                     ours[schedule]["loss_difference"]))
        for peer in peers_of:
            run = theirs[(peer, vpp)]
            run["figures"] = torch_figures(run["ranks"], args.warmup)
            run["loss_difference"] = max_relative_difference(run["losses"], reference)
            rows.append((f"torch {peer} ({vpp} stage{'s' if vpp > 1 else ''}/rank)", run["figures"],
                         run["loss_difference"]))
            labelled.append((f"{schedule} vs {peer}",
                             compare(ours[schedule], slowest_rank([r["step_seconds"] for r in run["ranks"]]),
                                     run["losses"], args.warmup, (PP, PP))))

    for run in ours.values():
        del run["spans"]  # thousands of spans; the JSON keeps what split_cost and the figures made of them
    print(runs_table(rows))
    print()
    print(comparison_table("torch", labelled))
    print()
    print(split_table(split))
    print()
    print("torch's split of Interleaf's own autograd Functions (torch_split.py):", split_check)
    name = "tiny model" if args.tiny else args.arch
    print(f"{name}; {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out")
    write_json(args.out, {
        "benchmark": "zero_bubble", "peer": "torch.distributed.pipelining", "arch": args.arch, "tiny": args.tiny,
        "machine_before": before, "machine_after": after, "steps": args.steps, "warmup": args.warmup,
        "steps_per_call": args.steps_per_call, "threads_per_process": 1,
        "interleaf": ours, "torch": list(theirs.values()), "comparisons": dict(labelled), "split": split,
        "torch_split_check": split_check,
    })
    print(f"results written to {args.out}")
    differ = [f"{label}: max relative loss difference {diff:.2e} from interleaf 1f1b's" for label, _, diff in rows
              if diff > LOSS_TOLERANCE]
    if differ:
        raise SystemExit("runs did not train the same run:\n  " + "\n  ".join(differ))


if __name__ == "__main__":
    main()
