"""Interleaf's ZeRO stages against torch's own implementations, side by side.

  zero=0 vs DistributedDataParallel           (gradients all-reduced, nothing sharded)
  zero=1 vs DDP + ZeroRedundancyOptimizer     (optimizer state sharded)
  zero=2 vs DistributedDataParallel           (torch has no ZeRO-2 of its own for DDP:
                                               the baseline stage 2 has to beat)
  zero=3 vs FSDP2 fully_shard, per block      (what a torch user runs)
  zero=3 vs FSDP2 fully_shard, whole model    (gathered once a step, as Interleaf's
                                               one chunk per rank is at pp=1)

each at dp=2 and dp=4 (pp=1, tp=1, 1f1b), on the same model, batch, weights and samples.
It reports the step-time ratio, each rank's peak resident set on both sides (measured
the same way), Interleaf's byte ledger by kind and the peers' state bytes, loss
agreement, and the coordinator's control time per RunSteps block. It exits non-zero
when the two sides' losses differ beyond measure.LOSS_TOLERANCE.

Each Interleaf job runs on a fresh cluster of dp stage servers and each peer run on a
fresh world of dp processes, one after the other: on a 2-core machine dp=4 puts two
one-thread processes on each core, on both sides alike.

    python bench/zero_vs_torch.py [--arch gpt2|llama] [--steps 8] [--warmup 2] [--steps-per-call 2] [--out PATH]
                                  [--dp 2 4] [--zero 0 1 2 3]
"""

from __future__ import annotations

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config

# Siblings in bench/ (the script's own directory is first on sys.path).
import torch_ddp
import torch_fsdp
import torch_zero1
from interleaf_run import run_job
from measure import (arguments, compare, comparison_table, fail_on_loss_disagreement, machine, slowest_rank,
                     steady, table, write_json)
from peer_world import PeerWorld
from workload import MODELS

PEERS = {  # ZeRO stage -> [(label, peer function, its extra arguments)]
    0: [("DDP", torch_ddp.train, ())],
    1: [("DDP + ZeroRedundancyOptimizer", torch_zero1.train, ())],
    2: [("DDP", torch_ddp.train, ())],
    3: [("FSDP2 per block", torch_fsdp.train, (True,)), ("FSDP2 whole model", torch_fsdp.train, (False,))],
}
HELD = ("parameters_bytes", "gradients_bytes", "optimizer_bytes")
PEAKS = ("parameters_peak_bytes", "gradients_peak_bytes", "activations_peak_bytes", "communication_peak_bytes",
         "peak_bytes")
LEDGER = HELD + PEAKS
MIB = 1 << 20


def overrides(arch: str, dp: int, zero: int, steps: int) -> list[str]:
    return MODELS[arch] + [
        f"parallel.dp={dp}", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1",
        "parallel.schedule=1f1b", "parallel.microbatches=4", f"parallel.zero={zero}",
        "train.global_batch=16", f"train.steps={steps}",
    ]


def memory(ours: dict, per_rank: list[dict], warmup: int) -> dict:
    """Per rank, over the steady steps: each side's peak resident set (the most of any
    step), Interleaf's ledger (state held at the last step, peaks the most of any step)
    and the peer's state bytes (tensor sizes after its last step)."""
    ranks = []
    for rank, peer in enumerate(per_rank):
        steps = [step[rank] for step in steady(ours["memory"], warmup)]
        ledger = {**{f: steps[-1][f] for f in HELD}, **{f: max(s[f] for s in steps) for f in PEAKS}}
        ranks.append({"rank": rank,
                      "interleaf_rss_peak_bytes": max(s["rss_peak_bytes"] for s in steps),
                      "peer_rss_peak_bytes": max(steady(peer["rss_peak_bytes"], warmup)),
                      "interleaf_ledger": ledger, "peer_state_bytes": peer["state_bytes"]})
    return {"ranks": ranks,
            "rss_ratio": max(r["interleaf_rss_peak_bytes"] for r in ranks) / max(r["peer_rss_peak_bytes"] for r in ranks)}


def run_stage(dp: int, zero: int, args) -> list[tuple[str, dict]]:
    """One ZeRO stage at `dp`: the Interleaf job on a fresh cluster of dp servers, then
    each peer on a fresh world of dp processes. Fresh processes on both sides, because
    a process's resident set carries the heap its earlier runs grew (a server or peer
    reused across runs reads higher each run), which would make the rss figures say
    more about the order of the runs than about the stage."""
    sets = overrides(args.arch, dp, zero, args.steps)
    cluster = LocalCluster(dp, threads_per_server=1, steps_per_call=args.steps_per_call)
    try:
        cluster.start()
        client = cluster.client()
        try:
            ours = run_job(client, sets)
        finally:
            client.close()
    finally:
        cluster.stop()
    labelled = []
    for name, fn, extra in PEERS[zero]:
        with PeerWorld(dp) as peers:
            per_rank = peers.run(fn, load_config("", sets), *extra)
        # Replicas hold equal rows, so the step's loss is the mean of theirs.
        losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in per_rank))]
        result = compare(ours, slowest_rank([r["step_seconds"] for r in per_rank]), losses, args.warmup, (dp, dp))
        labelled.append((f"zero={zero} dp={dp} vs {name}", {
            "zero": zero, "dp": dp, "peer_name": name, "overrides": sets,
            "memory": memory(ours, per_rank, args.warmup), **result}))
    return labelled


def _mib(values) -> str:
    return "/".join(f"{v / MIB:.0f}" for v in values)


def memory_tables(labelled: list[tuple[str, dict]]) -> str:
    rss = table(["", "interleaf rss peak MiB (per rank)", "peer rss peak MiB (per rank)", "rss ratio (max)"], [
        [label, _mib(r["interleaf_rss_peak_bytes"] for r in m["ranks"]),
         _mib(r["peer_rss_peak_bytes"] for r in m["ranks"]), f"{m['rss_ratio']:.2f}"]
        for label, m in ((label, r["memory"]) for label, r in labelled)])
    kinds = ["params", "grads", "optimizer", "params peak", "grads peak", "activ. peak", "comm peak", "peak"]
    peer_kinds = ["peer params", "peer grads", "peer optimizer"]
    ledger = table(["rank 0, MiB", *kinds, *peer_kinds], [
        [label, *(f"{rank0['interleaf_ledger'][f] / MIB:.1f}" for f in LEDGER),
         *(f"{rank0['peer_state_bytes'][k] / MIB:.1f}" for k in ("parameters", "gradients", "optimizer"))]
        for label, rank0 in ((label, r["memory"]["ranks"][0]) for label, r in labelled)])
    return rss + "\n\n" + ledger


def _options(parser) -> None:
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4], help="data-parallel sizes to run")
    parser.add_argument("--zero", type=int, nargs="+", choices=sorted(PEERS), default=sorted(PEERS),
                        help="ZeRO stages to run")


def main() -> None:
    args = arguments(__doc__.splitlines()[0], "zero_vs_torch", _options)
    before = machine()
    labelled = [pair for dp in args.dp for zero in args.zero for pair in run_stage(dp, zero, args)]
    after = machine()

    print(comparison_table("torch", labelled))
    print()
    print(memory_tables(labelled))
    print(f"{args.arch}; {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out, "
          f"{args.steps_per_call} steps per RunSteps block")
    write_json(args.out, {
        "benchmark": "zero_vs_torch", "arch": args.arch,
        "machine_before": before, "machine_after": after,
        "steps": args.steps, "warmup": args.warmup, "steps_per_call": args.steps_per_call,
        "threads_per_process": 1, "results": {label: r for label, r in labelled},
    })
    print(f"results written to {args.out}")
    fail_on_loss_disagreement(labelled)


if __name__ == "__main__":
    main()
