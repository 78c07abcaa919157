"""The data-parallel peer: torch DistributedDataParallel over the whole model, each
replica taking its half of every microbatch (the rows Interleaf's replica would take),
gradients accumulated over the microbatches and all-reduced once, on the last one.

Runs on every rank of a peer_world; returns that rank's per-step wall times and mean
losses (the mean over ranks is the step's loss: the replicas hold equal rows).
"""

from __future__ import annotations

import contextlib
import time

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from coordinator.config import JobConfig
from stageserver.model import GPTConfig, full_model

import torch_training  # sibling in bench/


def train(rank: int, config: JobConfig) -> dict:
    m, p, t = config.model, config.parallel, config.train
    replicas = dist.get_world_size()
    if p.dp != replicas or p.pp != 1 or p.tp != 1:
        raise ValueError(f"the DDP peer runs dp={replicas} with pp=tp=1")
    model = full_model(GPTConfig(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size), t.seed)
    ddp = DistributedDataParallel(model)
    params = list(model.parameters())
    optimizer, lr_schedule, sampler = torch_training.training_setup(config, [model])
    times, history = [], []
    for step in range(t.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        losses = []
        for mb in range(p.microbatches):
            inputs, targets = sampler.microbatch(step, mb, rank, replicas)
            # no_sync until the last microbatch: one all-reduce per step, as Interleaf's
            # REDUCE_GRADS after a chunk's last backward.
            last = mb == p.microbatches - 1
            with contextlib.nullcontext() if last else ddp.no_sync():
                loss = ddp(inputs, targets)
                (loss / p.microbatches).backward()
            losses.append(loss.item())
        # After DDP's all-reduce every replica holds the same averaged gradient: the
        # global norm is the local one.
        torch_training.clip_global_norm(params, params, t.grad_clip, across_ranks=False)
        torch_training.step(optimizer, lr_schedule, step)
        times.append(time.perf_counter() - started)
        history.append(sum(losses) / len(losses))
    return {"step_seconds": times, "losses": history}
