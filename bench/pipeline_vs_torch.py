"""Interleaf's pipeline schedules against torch.distributed.pipelining's, side by side.

For each schedule (GPipe, 1F1B, interleaved 1F1B with two chunks per rank) the same
model, layer split, microbatches and optimizer run twice on two processes with one
torch thread each: as an Interleaf job on a local cluster (coordinator + 2 stage
servers over gRPC, tensors over gloo), then as torch's schedule over gloo. The two runs
of a schedule follow each other, so both see the machine in the same state.

    python bench/pipeline_vs_torch.py [--arch gpt2|llama] [--steps 8] [--warmup 2] [--steps-per-call 2]
                                      [--out PATH]
"""

from __future__ import annotations


from interleaf.clients.client import Client
from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config

# Siblings in bench/ (the script's own directory is first on sys.path).
import torch_pipeline
from interleaf_run import run_job
from measure import (arguments, compare, comparison_table, fail_on_loss_disagreement, machine, slowest_rank,
                     write_json)
from peer_world import PeerWorld
from workload import MODELS

PP = 2
LAYOUTS = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)]  # (schedule, chunks per rank)


def overrides(arch: str, schedule: str, vpp: int, steps: int) -> list[str]:
    return MODELS[arch] + [
        "parallel.dp=1", "parallel.tp=1", f"parallel.pp={PP}", f"parallel.vpp={vpp}",
        f"parallel.schedule={schedule}", "parallel.microbatches=8",
        "train.global_batch=16", f"train.steps={steps}",
    ]


def run_schedule(client: Client, peers: PeerWorld, arch: str, schedule: str, vpp: int, steps: int,
                 warmup: int) -> dict:
    sets = overrides(arch, schedule, vpp, steps)
    ours = run_job(client, sets)
    per_rank = peers.run(torch_pipeline.train, load_config("", sets))
    losses = next(r["losses"] for r in per_rank if r["losses"] is not None)
    result = compare(ours, slowest_rank([r["step_seconds"] for r in per_rank]), losses, warmup, (PP, PP))
    return {"schedule": schedule, "vpp": vpp, "overrides": sets, **result}


def main() -> None:
    args = arguments(__doc__.splitlines()[0], "pipeline_vs_torch")

    before = machine()
    results = []
    cluster, peers = LocalCluster(PP, threads_per_server=1, steps_per_call=args.steps_per_call), PeerWorld(PP)
    try:
        cluster.start()
        peers.start()
        client = cluster.client()
        try:
            for schedule, vpp in LAYOUTS:
                results.append(run_schedule(client, peers, args.arch, schedule, vpp, args.steps, args.warmup))
        finally:
            client.close()
    finally:
        peers.close()
        cluster.stop()
    after = machine()

    labelled = [(r["schedule"] + (f" (vpp={r['vpp']})" if r["vpp"] > 1 else ""), r) for r in results]
    print(comparison_table("torch", labelled))
    print(f"{args.arch}; {before['cpus']} CPUs, load average {before['load_average_1m']} before, "
          f"{after['load_average_1m']} after; {args.steps} steps per run, first {args.warmup} left out")
    write_json(args.out, {
        "benchmark": "pipeline_vs_torch", "peer": "torch.distributed.pipelining", "arch": args.arch,
        "machine_before": before, "machine_after": after,
        "steps": args.steps, "warmup": args.warmup, "steps_per_call": args.steps_per_call,
        "threads_per_process": 1, "results": results,
    })
    print(f"results written to {args.out}")
    fail_on_loss_disagreement(labelled)


if __name__ == "__main__":
    main()
