"""Interleaf's data and tensor parallelism against their torch baselines, side by side.

  dp=2: two Interleaf replicas of the whole model against torch
        DistributedDataParallel on two processes, each replica taking half of every
        microbatch and all-reducing gradients once per step.
  tp=2: Interleaf's Megatron-style tensor parallelism over two processes against the
        whole model in one process (what tp=2 has to beat to be worth its traffic).

Every process runs one torch thread; each Interleaf run is followed at once by its peer.

    python bench/dp_tp_vs_torch.py [--arch gpt2|llama] [--steps 8] [--warmup 2] [--steps-per-call 2] [--out PATH]
"""

from __future__ import annotations


from interleaf.clients.client import Client
from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config

# Siblings in bench/ (the script's own directory is first on sys.path).
import single_process
import torch_ddp
from interleaf_run import run_job
from measure import (arguments, compare, comparison_table, fail_on_loss_disagreement, machine, slowest_rank,
                     write_json)
from peer_world import PeerWorld
from workload import MODELS


def overrides(arch: str, dp: int, tp: int, steps: int) -> list[str]:
    return MODELS[arch] + [
        f"parallel.dp={dp}", f"parallel.tp={tp}", "parallel.pp=1", "parallel.vpp=1",
        "parallel.schedule=1f1b", "parallel.microbatches=4",
        "train.global_batch=16", f"train.steps={steps}",
    ]


def run_pair(client: Client, peers: PeerWorld, peer_fn, sets: list[str], warmup: int) -> dict:
    config = load_config("", sets)
    ours = run_job(client, sets)
    per_rank = peers.run(peer_fn, config)
    # Replicas hold equal rows, so the step's loss is the mean of theirs.
    losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in per_rank))]
    processes = (config.parallel.dp * config.parallel.tp, peers.size)
    return {"overrides": sets,
            **compare(ours, slowest_rank([r["step_seconds"] for r in per_rank]), losses, warmup, processes)}


def main() -> None:
    args = arguments(__doc__.splitlines()[0], "dp_tp_vs_torch")

    before = machine()
    cluster = LocalCluster(2, threads_per_server=1, steps_per_call=args.steps_per_call)
    ddp_world, solo_world = PeerWorld(2), PeerWorld(1)
    try:
        cluster.start()
        ddp_world.start()
        solo_world.start()
        client = cluster.client()
        try:
            dp = run_pair(client, ddp_world, torch_ddp.train, overrides(args.arch, 2, 1, args.steps),
                          args.warmup)
            tp = run_pair(client, solo_world, single_process.train, overrides(args.arch, 1, 2, args.steps),
                          args.warmup)
        finally:
            client.close()
    finally:
        solo_world.close()
        ddp_world.close()
        cluster.stop()
    after = machine()

    labelled = [("dp=2 vs torch DDP", dp), ("tp=2 vs 1 process", tp)]
    print(comparison_table("peer", labelled))
    print(f"{args.arch}; {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out")
    write_json(args.out, {
        "benchmark": "dp_tp_vs_torch", "arch": args.arch,
        "machine_before": before, "machine_after": after,
        "steps": args.steps, "warmup": args.warmup, "steps_per_call": args.steps_per_call,
        "threads_per_process": 1,
        "results": {
            "dp": {"peer": "torch DistributedDataParallel, 2 processes", **dp},
            "tp": {"peer": "clients/reference.py in 1 process (half the cores Interleaf's 2 processes use)", **tp},
        },
    })
    print(f"results written to {args.out}")
    fail_on_loss_disagreement(labelled)


if __name__ == "__main__":
    main()
