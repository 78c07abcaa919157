"""The data-parallel peers checked on their own against Interleaf's single-process
reference (clients/reference.py): DDP, DDP + ZeroRedundancyOptimizer and FSDP2 (both
ways of cutting it into units), at dp=2 and dp=4, must give the reference's loss at
every step within measure.LOSS_TOLERANCE. Gradient clipping is active in these steps
(the global norm starts above train.grad_clip), so the sharded norm is checked too.

A peer that trained a different run (other samples, weights or optimizer arithmetic)
would make every ratio zero_vs_torch.py reports meaningless; this shows each peer is
right without Interleaf in the picture. Exits non-zero when one is not.

    python bench/peers_vs_reference.py [--arch gpt2|llama] [--steps 4]
"""

from __future__ import annotations

import argparse

from interleaf.coordinator.config import load_config

# Siblings in bench/ (the script's own directory is first on sys.path).
import single_process
import torch_ddp
import torch_fsdp
import torch_zero1
from measure import LOSS_TOLERANCE, max_relative_difference, table
from peer_world import PeerWorld
from workload import MODELS

PEERS = [("DDP", torch_ddp.train, ()), ("ZeRO-1 (ZeroRedundancyOptimizer)", torch_zero1.train, ()),
         ("FSDP2 per block", torch_fsdp.train, (True,)), ("FSDP2 whole model", torch_fsdp.train, (False,))]


def overrides(arch: str, dp: int, steps: int) -> list[str]:
    return MODELS[arch] + [
        f"parallel.dp={dp}", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1",
        "parallel.schedule=1f1b", "parallel.microbatches=4",
        "train.global_batch=16", f"train.steps={steps}",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=sorted(MODELS), default="gpt2")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    # The reference depends on the global batch only, not on dp: one run serves both.
    with PeerWorld(1) as solo:
        reference = solo.run(single_process.train, load_config("", overrides(args.arch, 1, args.steps)))[0]["losses"]
    rows, failed = [], []
    for dp in (2, 4):
        with PeerWorld(dp) as world:
            for name, train, extra in PEERS:
                per_rank = world.run(train, load_config("", overrides(args.arch, dp, args.steps)), *extra)
                losses = [sum(step) / len(step) for step in zip(*(r["losses"] for r in per_rank))]
                difference = max_relative_difference(losses, reference)
                rows.append([f"{name}, dp={dp}", " ".join(f"{x:.6f}" for x in losses), f"{difference:.1e}"])
                if difference > LOSS_TOLERANCE:
                    failed.append(rows[-1][0])
    print("reference losses: " + " ".join(f"{x:.6f}" for x in reference))
    print(table(["peer", "losses per step", "max rel. diff vs reference"], rows))
    if failed:
        raise SystemExit(f"peers off the reference by more than {LOSS_TOLERANCE:.0e}: {', '.join(failed)}")
    print(f"every peer within {LOSS_TOLERANCE:.0e} of the reference at every step")


if __name__ == "__main__":
    main()
