"""What metrics and tracing cost a training step: the same job, alternately unobserved
and fully observed, in the same process tree and minute.

- side A, unobserved: stage servers started with `--metrics-port -1` (no metrics, no
  HTTP server, no communication metering) and `trace.steps = []` (no step traced);
- side B, observed: stage servers with their metrics on, a thread of this process
  fetching every second, as Prometheus would, each server's /metrics, the
  coordinator's /metrics and its /sd, and every step traced (`trace.steps` = every step,
  up to the 64 the coordinator keeps).

Each side has a local cluster of its own (a coordinator and its stage servers), both
started before the first job; the jobs run A B A B ..., one at a time. The
coordinator's own metrics are kept on both sides (it has no switch); only B's are
fetched. Reported per side: the median and the fastest step time as the servers
measure it (the slowest rank's, after warm-up), the coordinator's tokens/s (a step's tokens over the
wall time since the previous step completed: control and report delivery, where the
traces travel, are in it) and its control time per RunSteps block, each with its spread
over the rounds; and B over A. A ratio closer to 1 than the rounds of one side are to
each other is noise. Every job must produce the same losses.

    python bench/observability_cost.py [--rounds 5] [--steps 64] [--warmup 4] [--steps-per-call 8] [--out PATH]
    python bench/observability_cost.py --device cuda --model large    # one GPU: one server, pp=1, bf16
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import urllib.request

from interleaf.clients.client import Client
from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import MAX_TRACED_STEPS

# Siblings in bench/ (the script's own directory is first on sys.path).
from interleaf_run import run_job
from measure import machine, max_relative_difference, steady as steps_after_warmup, table, write_json

MODELS = {
    # About 50 ms a step on 2 one-thread CPU processes: short enough that a per-step or
    # per-action cost would show, long enough to be measured to a fraction of a percent.
    "small": ["model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.seq_len=64",
              "model.vocab_size=256", "parallel.microbatches=4", "train.global_batch=8"],
    # For a GPU: 8 layers of d_model 1024 over 1024-token samples, 16 samples a step.
    "large": ["model.n_layers=8", "model.d_model=1024", "model.n_heads=16", "model.seq_len=1024",
              "model.vocab_size=50304", "parallel.microbatches=4", "train.global_batch=16"],
}
SCRAPE_INTERVAL_S = 1.0
PROMETHEUS_ACCEPT = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
GPU_FIRST_STEPS, GPU_FIRST_STEPS_TOLERANCE = 3, 1e-4
"""On a GPU, jobs on the same weights and samples differ in the last bits: attention's
backward and some reductions are not deterministic there. Over many bf16 steps those bits
grow into percent-level loss differences between any two runs, observed or not (seen on
an H100: 6e-2 between two unobserved jobs by step 64). So on a GPU the check is that
(1) every job's first GPU_FIRST_STEPS losses agree within GPU_FIRST_STEPS_TOLERANCE, and
(2) observed jobs differ from the first unobserved one no more than the other unobserved
jobs do (twice their largest difference, at least): watching a job changes nothing the
GPU's own run-to-run differences do not. On a CPU every job's losses must be identical."""


class Scraper(threading.Thread):
    """Fetches every URL once per interval, with Prometheus's Accept header, until
    stopped; counts fetches, bytes and failures."""

    def __init__(self, urls: list[str]):
        super().__init__(name="scraper", daemon=True)
        self.urls, self.stop = urls, threading.Event()
        self.fetches, self.bytes, self.failures, self.seconds = 0, 0, [], 0.0

    def run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            for url in self.urls:
                try:
                    request = urllib.request.Request(url, headers={"Accept": PROMETHEUS_ACCEPT})
                    with urllib.request.urlopen(request, timeout=10) as reply:
                        self.bytes += len(reply.read())
                    self.fetches += 1
                except OSError as err:
                    self.failures.append(f"{url}: {err}")
            self.seconds += time.perf_counter() - started
            self.stop.wait(max(0.0, SCRAPE_INTERVAL_S - (time.perf_counter() - started)))


def scrape_urls(cluster: LocalCluster, client: Client) -> list[str]:
    """What Prometheus with docker/prometheus.yml would fetch: the coordinator's metrics,
    its service discovery, and every server it lists."""
    servers = [f"http://{s.address.rsplit(':', 1)[0]}:{s.metrics_port}/metrics" for s in client.servers()]
    if len(servers) != cluster.count or any(url.endswith(":0/metrics") for url in servers):
        raise RuntimeError(f"the observed side's servers do not all serve metrics: {servers}")
    return [f"http://{cluster.http_address}/metrics", f"http://{cluster.http_address}/sd", *servers]


def overrides(args: argparse.Namespace, observed: bool) -> list[str]:
    if args.device == "cuda":  # one GPU: NCCL refuses two ranks on one device
        layout = ["parallel.pp=1", "parallel.vpp=1", "parallel.transport=nccl", "train.precision=bf16"]
    else:
        layout = ["parallel.pp=2", "parallel.vpp=1", "parallel.transport=gloo"]
    traced = list(range(min(args.steps, MAX_TRACED_STEPS))) if observed else []
    return [*MODELS[args.model], *layout, "parallel.dp=1", "parallel.tp=1", "parallel.schedule=1f1b",
            f"train.steps={args.steps}", f"trace.steps={traced}"]


def run_side(client: Client, cluster: LocalCluster, args: argparse.Namespace, observed: bool) -> dict:
    scraper = Scraper(scrape_urls(cluster, client)) if observed else None
    if scraper:
        scraper.start()
    try:
        result = run_job(client, overrides(args, observed))
    finally:
        if scraper:
            scraper.stop.set()
            scraper.join()
    if scraper:
        if scraper.failures or not scraper.fetches:
            raise RuntimeError(f"scraping failed: {scraper.fetches} fetches, {scraper.failures[:3]}")
        result["scrapes"] = {"urls": scraper.urls, "fetches": scraper.fetches, "bytes": scraper.bytes,
                             "seconds": scraper.seconds}
        last = args.steps - 1
        result["traced_last_step_spans"] = sum(len(r.spans) for r in client.trace(result["job_id"], last).reports)
    return result


def steady(run: dict, key: str, warmup: int) -> list[float]:
    """A job's figures after warm-up: per step, or for control time per RunSteps block
    (the blocks that start after it)."""
    if key == "control_seconds":
        return [b["control_seconds"] for b in run["blocks"] if b["first_step"] >= warmup]
    return steps_after_warmup(run[key], warmup)


def summarize(runs: list[dict], warmup: int) -> dict:
    """A side's figures, `value` each over every round's steady figures together (the
    median; for the fastest step the least, which other processes on a shared machine
    cannot lower), `rounds` each round's own, and `spread` theirs: (largest - smallest)
    / value."""
    def figure(key: str, reduce=statistics.median) -> dict:
        per_round = [reduce(steady(r, key, warmup)) for r in runs]
        pooled = reduce([v for r in runs for v in steady(r, key, warmup)])
        return {"value": pooled, "rounds": per_round, "spread": (max(per_round) - min(per_round)) / pooled}

    return {"step_seconds": figure("step_seconds"), "fastest_step_seconds": figure("step_seconds", min),
            "tokens_per_second": figure("tokens_per_second"), "control_seconds": figure("control_seconds")}


def compare(a: dict, b: dict) -> dict:
    ratio = b["value"] / a["value"]
    noise = max(a["spread"], b["spread"])
    paired = [y / x for x, y in zip(a["rounds"], b["rounds"])]
    return {"ratio": ratio, "noise": noise, "within_noise": abs(ratio - 1) <= noise,
            "round_ratios": paired}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="jobs per side, alternating A B A B ...")
    parser.add_argument("--steps", type=int, default=64, help="steps per job, warm-up included")
    parser.add_argument("--warmup", type=int, default=4, help="first steps of each job left out")
    parser.add_argument("--steps-per-call", type=int, default=8, help="steps per RunSteps call (the default)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: 2 stage servers, pp=2; cuda: 1 server on GPU 0, pp=1, bf16")
    parser.add_argument("--model", choices=sorted(MODELS), default=None,
                        help="small (default on cpu) or large (default on cuda)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results",
                                                      "observability_cost.json"))
    args = parser.parse_args()
    args.model = args.model or ("large" if args.device == "cuda" else "small")
    if args.rounds < 2 or args.steps <= args.warmup:
        parser.error("--rounds must be at least 2 and --steps more than --warmup")

    servers = 1 if args.device == "cuda" else 2
    threads = 1 if args.device == "cpu" else None
    before = machine()
    runs: dict[str, list[dict]] = {"unobserved": [], "observed": []}
    clusters = {side: LocalCluster(servers, threads_per_server=threads, steps_per_call=args.steps_per_call,
                                   device=args.device, metrics=side == "observed") for side in runs}
    clients = {}
    try:
        for side, cluster in clusters.items():
            cluster.start()
            clients[side] = cluster.client()
        for i in range(args.rounds):
            for side in runs:
                runs[side].append(run_side(clients[side], clusters[side], args, side == "observed"))
                print(f"round {i + 1}/{args.rounds} {side}: median step "
                      f"{statistics.median(runs[side][-1]['step_seconds'][args.warmup:]) * 1000:.2f} ms", flush=True)
    finally:
        for client in clients.values():
            client.close()
        for cluster in clusters.values():
            cluster.stop()
    after = machine()

    reference = runs["unobserved"][0]["losses"]
    differences = [max_relative_difference(r["losses"], reference) for side in runs for r in runs[side]]
    a, b = summarize(runs["unobserved"], args.warmup), summarize(runs["observed"], args.warmup)
    results = {key: compare(a[key], b[key]) for key in a}

    rows = []
    for key, label, scale, unit in (("step_seconds", "step time (servers)", 1000, "ms"),
                                    ("fastest_step_seconds", "fastest step (servers)", 1000, "ms"),
                                    ("tokens_per_second", "tokens/s (coordinator)", 1, ""),
                                    ("control_seconds", "control per block", 1000, "ms")):
        r = results[key]
        rows.append([label, f"{a[key]['value'] * scale:.2f} {unit}".strip(), f"{a[key]['spread']:.1%}",
                     f"{b[key]['value'] * scale:.2f} {unit}".strip(), f"{b[key]['spread']:.1%}",
                     f"{r['ratio']:.4f}", f"{min(r['round_ratios']):.3f}-{max(r['round_ratios']):.3f}",
                     "noise" if r["within_noise"] else f"{r['ratio'] - 1:+.1%}"])
    print(table(["", "A: unobserved", "spread", "B: observed", "spread", "B/A", "per round", "reading"], rows))
    scrapes = runs["observed"][-1]["scrapes"]
    print(f"{args.device}, model {args.model}, {servers} server(s); {args.rounds} rounds of {args.steps} steps, first "
          f"{args.warmup} left out; B traced {min(args.steps, MAX_TRACED_STEPS)} steps and fetched "
          f"{len(scrapes['urls'])} URLs every {SCRAPE_INTERVAL_S:g} s ({scrapes['fetches']} fetches in its last job)")
    print(f"losses: largest relative difference between any two jobs {max(differences):.1e}; "
          f"{before['cpus']} CPUs, load average {before['load_average_1m']} before, {after['load_average_1m']} after")
    write_json(args.out, {
        "benchmark": "observability_cost", "device": args.device, "model": args.model, "servers": servers,
        "overrides": {side: overrides(args, side == "observed") for side in runs},
        "machine_before": before, "machine_after": after, "rounds": args.rounds, "steps": args.steps,
        "warmup": args.warmup, "steps_per_call": args.steps_per_call,
        "unobserved": a, "observed": b, "observed_over_unobserved": results,
        "max_relative_loss_difference": max(differences), "runs": runs,
    })
    print(f"results written to {args.out}")
    if args.device == "cpu" and max(differences) > 0.0:
        raise SystemExit(f"the jobs did not train the same run: largest relative loss difference "
                         f"{max(differences):.2e} > 0")
    if args.device == "cuda":
        first = max(max_relative_difference(r["losses"][:GPU_FIRST_STEPS], reference[:GPU_FIRST_STEPS])
                    for side in runs for r in runs[side])
        among_unobserved = max(max_relative_difference(r["losses"], reference) for r in runs["unobserved"][1:])
        observed = max(max_relative_difference(r["losses"], reference) for r in runs["observed"])
        print(f"GPU run-to-run: first {GPU_FIRST_STEPS} steps within {first:.1e}; over all steps, unobserved jobs "
              f"differ from the first by up to {among_unobserved:.1e}, observed ones by up to {observed:.1e}")
        if first > GPU_FIRST_STEPS_TOLERANCE or observed > 2 * among_unobserved:
            raise SystemExit("the jobs did not train the same run: observed jobs differ from unobserved ones "
                             "beyond the GPU's own run-to-run differences")


if __name__ == "__main__":
    main()
