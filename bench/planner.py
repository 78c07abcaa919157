"""The planner's predictions against measured steps (`interleaf plan`, docs/planning.md).

On one local cluster (a coordinator and 2 stage servers of one torch thread each, the
workload of every benchmark: workload.py), this

1. measures the device profile afresh on the cluster's servers (the profile jobs
   `interleaf plan` runs when nothing is cached: clients/plan_profile.py), and as the
   plan does, times the chunk shapes of the plans its laws rank first
   (plan_command.search_timed);
2. runs a hand grid of layouts (HAND_GRID: data, tensor and pipeline parallelism, every
   schedule, microbatch counts, ZeRO, recompute, an uneven split), each for --steps
   steps, in ROUNDS rounds (the grid in order, then reversed, then in order), and takes for each the
   least of its rounds' median steady step times (the slowest rank's step inside the
   servers, what the simulator predicts): steps on this 2-core machine vary by up to a
   quarter between runs minutes apart, and the least is the one least disturbed;
3. predicts each of them with the planner's cost model and simulator;
4. asks the planner for its best layout and runs it too, unless the grid holds it;
5. runs the planned layout, the grid's measured best and the default PLAYOFF_ROUNDS
   more rounds, those three alone in alternating order: the comparison the targets
   make between them rests on six rounds each (the least median of all of them),
   while the rank correlation and errors use the first three of every layout alike.

It reports the Spearman rank correlation of predicted against measured step times, the
median and worst relative error, and the planned layout's measured step against the
grid's best and the default layout's (parallel's defaults: pp=2, vpp=2, interleaved
1F1B, 4 microbatches; on one server, 1F1B's 4 microbatches with no pipeline). Every
run trains the same run: each one's losses must agree with the first's within
measure.LOSS_TOLERANCE (BF16_LOSS_TOLERANCE in bf16), or the script exits non-zero
after writing its JSON; it also exits non-zero when a target (Spearman >= 0.8, median
error <= 15%, the plan at least as fast as the grid's best within NOISE, faster than the
default) is missed.

Memory: each run's measured peak (the servers' ledger, and on a GPU torch's
max_memory_allocated) beside the memory model's prediction for the busiest rank.

    python bench/planner.py [--arch gpt2|llama] [--steps 8] [--warmup 2] [--tiny] [--out PATH]
    python bench/planner.py --device cuda --servers 1 --out results/gpu/planner.json   # one GPU
    ... --rounds 1 --playoff-rounds 1   # fewer rounds, where steps vary little between runs (a GPU)

--device cuda --servers 1: one stage server on the GPU, a 12-layer d_model 1024 GPT of
1024-token samples in bf16, and the layouts one server runs (GPU_GRID: microbatch counts
and recompute modes); the same targets, and the planned job's measured device peak
within 10% of the memory model's.

--tiny: a 4-layer model of d_model 32 for 3 steps on four layouts, a check that
everything runs (seconds); its figures mean nothing and no target is held.
"""

from __future__ import annotations

import os
import statistics
import time

from interleaf.clients import plan_command, plan_profile
from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.coordinator.memory_model import predict, with_temporaries
from interleaf.coordinator.planner.candidates import Layout, apply
from interleaf.coordinator.planner.costs import layout_costs
from interleaf.coordinator.planner.search import Cluster, programs_for, simulate_layout

# Siblings in bench/ (the script's own directory is first on sys.path).
from interleaf_run import exit_cleanly_on_sigterm, run_job
from measure import LOSS_TOLERANCE, arguments, machine, max_relative_difference, steady, table, write_json
from workload import MODELS

SERVERS = 2
GLOBAL_BATCH = 16
ROUNDS = 3
PLAYOFF_ROUNDS = 3
NOISE = 0.05
"""Run-to-run spread of a step on this machine: a plan within it of the grid's best is
as fast."""


def L(dp=1, tp=1, pp=1, vpp=1, schedule="1f1b", m=1, zero=0, recompute="none", sp=False, layers=()):
    return Layout(dp, tp, pp, vpp, schedule, m, zero, recompute, sp, tuple(layers))


DEFAULT = L(pp=2, vpp=2, schedule="interleaved-1f1b", m=4)
ONE_SERVER_DEFAULT = L(m=4)
"""What parallel's defaults leave on one server, which holds no pipeline: 4 microbatches."""
BF16_LOSS_TOLERANCE = 1e-3
"""Between layouts trained in bf16 (the GPU run), whose microbatches' gradients round
differently: 100x measure.LOSS_TOLERANCE (an H200's 15 layouts differed by at most 8.8e-5
over 6 steps), below what a different sample or update moves a loss."""
HAND_GRID = [
    L(dp=2, m=1), L(dp=2, m=2), L(dp=2, m=4), L(dp=2, m=2, zero=3), L(dp=2, m=2, recompute="full"),
    L(dp=2, m=8, recompute="full"),
    L(tp=2, m=1), L(tp=2, m=4, sp=True), L(tp=2, m=2, recompute="full"),
    L(pp=2, schedule="gpipe", m=4), L(pp=2, m=2), L(pp=2, m=8), L(pp=2, m=16), L(pp=2, schedule="zb-h1", m=4),
    DEFAULT, L(pp=2, vpp=4, schedule="interleaved-1f1b", m=8), L(pp=2, vpp=2, schedule="zbv", m=4),
    L(pp=2, m=4, recompute="selective"), L(pp=2, m=4, layers=(5, 3)), L(pp=2, m=4, layers=(6, 2)),
]
GPU_MODEL = ["model.n_layers=12", "model.d_model=1024", "model.n_heads=16", "model.seq_len=1024",
             "model.vocab_size=50304", "train.precision=bf16"]
GPU_GRID = [L(m=m, recompute=r) for m in (1, 2, 4, 8, 16) for r in ("none", "selective", "full")]
TINY_MODEL = ["model.n_layers=4", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.vocab_size=256"]
TINY_GRID = [L(dp=2, m=2), L(tp=2, m=2), L(pp=2, m=4), DEFAULT]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation (ties take their mean rank)."""
    def ranks(values):
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out
    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb))
    var = (sum((x - mean_a) ** 2 for x in ra) * sum((y - mean_b) ** 2 for y in rb)) ** 0.5
    return cov / var if var else 0.0


def settings(layout: Layout) -> list[str]:
    return plan_command.overrides({"parallel": layout.parallel(), "train": layout.train()})


def predicted_step(config, layout: Layout, profile, cluster: Cluster) -> float:
    job = apply(config, layout)
    return simulate_layout(job, programs_for(job), layout_costs(job, profile, cluster.compute_slowdown)).makespan_s


def options(parser) -> None:
    parser.add_argument("--tiny", action="store_true", help="a seconds-long check that it runs")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the stage servers compute")
    parser.add_argument("--servers", type=int, default=SERVERS, help="stage servers (1 on a one-GPU machine)")
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"rounds of the whole grid (default {ROUNDS})")
    parser.add_argument("--playoff-rounds", type=int, default=PLAYOFF_ROUNDS,
                        help=f"more rounds of the plan, the grid's best and the default (default {PLAYOFF_ROUNDS})")


def peaks(result: dict, device: str) -> int:
    """The most any rank held in any steady step: the ledger's peak, or on a GPU the
    allocator's."""
    field = "device_peak_bytes" if device == "cuda" else "peak_bytes"
    return max(rank[field] for step in result["memory"][1:] for rank in step)


def main() -> int:
    exit_cleanly_on_sigterm()
    args = arguments(__doc__.splitlines()[0], "planner", options)
    gpu = args.device == "cuda"
    model = TINY_MODEL if args.tiny else GPU_MODEL if gpu else MODELS[args.arch]
    steps = 3 if args.tiny else args.steps
    warmup = 1 if args.tiny else args.warmup
    grid = TINY_GRID if args.tiny else GPU_GRID if gpu else HAND_GRID
    grid = [layout for layout in grid if layout.dp * layout.tp * layout.pp == args.servers]
    base = [*model, f"train.global_batch={GLOBAL_BATCH}", f"train.steps={steps}", "checkpoint.every=0"]
    config = load_config("", base)
    default_layout = DEFAULT if args.servers > 1 else ONE_SERVER_DEFAULT
    before = machine()
    runs: list[dict] = []
    with LocalCluster(args.servers, steps_per_call=args.steps_per_call, device=args.device) as cluster:
        client = cluster.client()
        kind = plan_command.device_kind(cluster.devices[0])
        profiling = time.monotonic()
        memory = cluster.memory_per_server
        profile = plan_profile.measure(client, config, kind, args.servers, memory,
                                       log=lambda line: print(line, flush=True))
        profile_seconds = time.monotonic() - profiling
        slowdown = 1.0 if gpu else plan_command.host_slowdown(args.servers, cluster.threads, os.cpu_count() or 1)
        planning = Cluster(args.servers, memory, servers_per_host=args.servers, compute_slowdown=slowdown,
                           device_type="cuda" if gpu else "cpu")
        # as `interleaf plan` does: the top plans' chunk shapes timed on the servers, the search repeated
        timing = time.monotonic()
        servers = plan_command.ProfileServers(lambda: plan_command.given_servers(client, args.servers), args.servers,
                                              memory, slowdown)
        report, profile = plan_command.search_timed(config, planning, profile, 5, servers,
                                                    log=lambda line: print(line, flush=True), keep=False)
        shape_seconds = time.monotonic() - timing
        plan = report.plans[0].layout
        layouts = grid + ([] if plan in grid else [plan])
        rounds: dict[Layout, list[dict]] = {layout: [] for layout in layouts}
        grid_rounds = max(1, args.rounds)
        playoff_rounds = 1 if args.tiny else max(0, args.playoff_rounds)

        predictions: dict[Layout, float] = {}

        def prediction(layout: Layout) -> float:
            """The simulator's step for `layout`, once per layout (the partial writes ask again)."""
            if layout not in predictions:
                predictions[layout] = predicted_step(config, layout, profile, planning)
            return predictions[layout]

        def median_steps(layout: Layout) -> list[float]:
            return [statistics.median(steady(r["step_seconds"], warmup)) for r in rounds[layout]]

        def measure(layout: Layout) -> None:
            """One run of `layout`; the runs so far written at once, with their
            predictions, so that a bench cut short (a GPU lease) keeps them."""
            rounds[layout].append(run_job(client, base + settings(layout)))
            write_json(args.out, {"benchmark": "planner", "partial": True, "servers": args.servers,
                                  "device": args.device, "model": model, "plan": plan.describe(),
                                  "profile": profile.to_json(),
                                  "runs": [{"layout": done.describe(), "round_medians_s": median_steps(done),
                                            "predicted_step_s": prediction(done)}
                                           for done in layouts if rounds[done]]})

        for order in range(grid_rounds):  # forward, then backward: drift on the machine hits both ends alike
            for layout in (layouts if order % 2 == 0 else layouts[::-1]):
                measure(layout)

        # The comparison the targets make, between the plan, the grid's best and the
        # default, gets PLAYOFF_ROUNDS more rounds of those three alone, alternating.
        leader = min(grid, key=lambda layout: min(median_steps(layout)))
        finalists = list(dict.fromkeys([plan, leader] + ([default_layout] if default_layout in layouts else [])))
        main_rounds = {layout: len(rounds[layout]) for layout in layouts}
        for order in range(playoff_rounds):
            for layout in (finalists if order % 2 == 0 else finalists[::-1]):
                measure(layout)
        for layout in layouts:
            everything = median_steps(layout)
            medians = everything[:main_rounds[layout]]
            measured = min(medians)
            predicted = prediction(layout)
            job = apply(config, layout)
            # the device's peak holds the loss's forward temporaries, the ledger's does not
            predicted_peak = max(with_temporaries(p) if gpu else p["peak_bytes"]
                                 for p in predict(job, programs_for(job), planning.device_type))
            measured_peak = min(peaks(r, args.device) for r in rounds[layout])
            runs.append({"layout": layout.describe(), "settings": settings(layout), "in_grid": layout in grid,
                         "planned": layout == plan, "default": layout == default_layout,
                         "finalist": layout in finalists, "measured_step_s": measured,
                         "round_medians_s": medians, "playoff_medians_s": everything[len(medians):],
                         "decided_step_s": min(everything), "predicted_step_s": predicted,
                         "error": predicted / measured - 1, "losses": rounds[layout][0]["losses"],
                         "predicted_peak_bytes": predicted_peak, "measured_peak_bytes": measured_peak,
                         "peak_error": predicted_peak / measured_peak - 1 if measured_peak else None})
            print(f"{layout.describe():<52} measured {measured:.4f} s (rounds {', '.join(f'{m:.4f}' for m in medians)}),"
                  f" predicted {predicted:.4f} s ({predicted / measured - 1:+.1%})", flush=True)
    grid_runs = [r for r in runs if r["in_grid"]]
    rho = spearman([r["predicted_step_s"] for r in grid_runs], [r["measured_step_s"] for r in grid_runs])
    errors = sorted(abs(r["error"]) for r in grid_runs)
    median_error = statistics.median(errors)
    planned = next(r for r in runs if r["planned"])
    # the grid's best after the playoff: the fastest of its finalists (the leader, and the plan or the
    # default where the grid holds them)
    best = min((r for r in grid_runs if r["finalist"]), key=lambda r: r["decided_step_s"])
    default = next((r for r in runs if r["default"]), None)
    tolerance = LOSS_TOLERANCE if config.train.precision in ("fp32", "fp64") else BF16_LOSS_TOLERANCE
    disagree = [r["layout"] for r in runs
                if max_relative_difference(r["losses"], runs[0]["losses"]) > tolerance]
    summary = {
        "spearman": rho, "median_abs_error": median_error, "worst_abs_error": errors[-1],
        "planned": planned["layout"], "planned_step_s": planned["decided_step_s"],
        "grid_best": best["layout"], "grid_best_step_s": best["decided_step_s"],
        "default_step_s": default and default["decided_step_s"],
        "planned_vs_grid_best": planned["decided_step_s"] / best["decided_step_s"],
        "planned_vs_default": default and planned["decided_step_s"] / default["decided_step_s"],
        "planned_peak_error": planned["peak_error"],
        "profile_seconds": profile_seconds, "shape_timing_seconds": shape_seconds, "shapes_timed": len(profile.shapes),
        "search": {"candidates": report.candidates, "simulated": report.simulated, "seconds": report.seconds},
        "losses_disagree": disagree,
    }
    write_json(args.out, {"benchmark": "planner", "machine_before": before, "machine_after": machine(),
                          "servers": args.servers, "device": args.device, "compute_slowdown": slowdown,
                          "model": model, "global_batch": GLOBAL_BATCH, "steps": steps,
                          "warmup": warmup, "rounds": grid_rounds, "playoff_rounds": playoff_rounds, "profile": profile.to_json(), "runs": runs, "summary": summary})
    rows = [[r["layout"] + (" (planned)" if r["planned"] else "") + (" (default)" if r["default"] else ""),
             f"{r['measured_step_s']:.4f}", f"{r['predicted_step_s']:.4f}", f"{r['error']:+.1%}",
             f"{r['measured_peak_bytes'] / 2**20:.1f}", f"{r['predicted_peak_bytes'] / 2**20:.1f}"]
            for r in sorted(runs, key=lambda r: r["measured_step_s"])]
    print(table(["layout", "measured s", "predicted s", "error", "peak MiB", "predicted MiB"], rows))
    print(f"Spearman {rho:.3f}; median |error| {median_error:.1%}, worst {errors[-1]:.1%}; planned "
          f"{planned['layout']}: {summary['planned_vs_grid_best']:.3f}x the grid's best step ({best['layout']})"
          + (f", {summary['planned_vs_default']:.3f}x the default's" if default else ""))
    missed = []
    if disagree:
        missed.append(f"losses differ from the first run's: {', '.join(disagree)}")
    if not args.tiny:
        if rho < 0.8:
            missed.append(f"Spearman {rho:.3f} < 0.8")
        if median_error > 0.15:
            missed.append(f"median error {median_error:.1%} > 15%")
        if summary["planned_vs_grid_best"] > 1 + NOISE:
            missed.append(f"the plan is {summary['planned_vs_grid_best']:.3f}x the grid's best")
        # a plan that is the default layout is held to the grid's best above, not to itself
        if default and not planned["default"] and summary["planned_vs_default"] >= 1:
            missed.append(f"the plan is not faster than the default ({summary['planned_vs_default']:.3f}x)")
        if gpu and planned["peak_error"] is not None and abs(planned["peak_error"]) > 0.10:
            missed.append(f"the planned job's device peak is {planned['peak_error']:+.1%} from the memory model's")
    for line in missed:
        print(f"MISSED: {line}")
    return 1 if missed else 0


if __name__ == "__main__":
    raise SystemExit(main())
