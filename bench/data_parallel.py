"""The step loop every data-parallel peer runs (DDP, DDP + ZeroRedundancyOptimizer,
FSDP2): each replica takes its rows of every microbatch (the rows Interleaf's replica d
of dp takes), gradients accumulate over the microbatches and are reduced once, on the
last; then clipping by the global norm and the optimizer step, as Interleaf does.

What differs between peers is passed in: how a microbatch runs forward and backward
(and whether its gradients are reduced), where the gradients are, and whether they are
sharded (their norm then sums the shards' squares over the ranks).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from interleaf.coordinator.config import JobConfig

import memory  # siblings in bench/
import torch_training


def check_layout(config: JobConfig, peer: str) -> int:
    """The number of replicas, after checking the job is plain data parallelism over
    every process of the peer world."""
    p, replicas = config.parallel, dist.get_world_size()
    if p.dp != replicas or p.pp != 1 or p.tp != 1:
        raise ValueError(f"the {peer} peer runs dp={replicas} (its world) with pp=tp=1, "
                         f"not dp={p.dp} pp={p.pp} tp={p.tp}")
    return replicas


def train_steps(rank: int, config: JobConfig,
                microbatch: Callable[[torch.Tensor, torch.Tensor, bool], torch.Tensor],
                grads: Callable[[], list[torch.Tensor]], sharded: bool,
                optimizer, lr_schedule, sampler) -> dict:
    """Runs config.train.steps steps. `microbatch(inputs, targets, last)` runs forward
    and backward of one microbatch (the loss scaled by 1/microbatches, so the sum over
    microbatches is the mean) and returns the unscaled loss; it reduces gradients
    across replicas only when `last`. `grads()` gives this rank's gradient tensors after
    the reduction: full copies (`sharded` False, the norm is local) or this rank's
    shards (`sharded` True, squares summed over ranks).

    Returns per step: wall time, this rank's mean loss (the mean over ranks is the
    step's loss: replicas hold equal rows), and the process's peak resident set."""
    p, t = config.parallel, config.train
    replicas = dist.get_world_size()
    times, history, rss = [], [], []
    for step in range(t.steps):
        memory.reset_peak()
        started = time.perf_counter()
        optimizer.zero_grad()
        losses = []
        for mb in range(p.microbatches):
            inputs, targets = sampler.microbatch(step, mb, rank, replicas)
            losses.append(microbatch(inputs, targets, mb == p.microbatches - 1).item())
        local = grads()
        torch_training.clip_global_norm(local, local, t.grad_clip, across_ranks=sharded)
        torch_training.step(optimizer, lr_schedule, step)
        times.append(time.perf_counter() - started)
        rss.append(memory.peak_rss_bytes())
        history.append(sum(losses) / len(losses))
    return {"step_seconds": times, "losses": history, "rss_peak_bytes": rss}
