"""The data-parallel peer: torch DistributedDataParallel over the whole model, each
replica taking its rows of every microbatch, gradients accumulated over the microbatches
and all-reduced once, on the last one (data_parallel.py).

Runs on every rank of a peer_world; returns that rank's per-step wall times, mean
losses and peak resident set, and the training state it holds.
"""

from __future__ import annotations

import contextlib

from torch.nn.parallel import DistributedDataParallel

from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import JobConfig
from interleaf.stageserver.model import full_model

import data_parallel  # siblings in bench/
import memory
import torch_training


def train(rank: int, config: JobConfig, bucket_cap_mb: float | None = None) -> dict:
    """`bucket_cap_mb`: DDP's bucket size (None: its default, 25 MiB after a first bucket
    of 1 MiB)."""
    return train_with(rank, config, "DDP", torch_training.adamw, lambda optimizer: optimizer.state, bucket_cap_mb)


def train_with(rank: int, config: JobConfig, name: str, make_optimizer, optimizer_state,
               bucket_cap_mb: float | None = None) -> dict:
    """DDP with `make_optimizer(chunks, weight_decay)`; `optimizer_state(optimizer)` is
    the state this rank holds (ZeRO-1's peer passes its sharded optimizer)."""
    m, p, t = config.model, config.parallel, config.train
    data_parallel.check_layout(config, name)
    model = full_model(shape_of(m), t.seed)
    ddp = DistributedDataParallel(model) if bucket_cap_mb is None else DistributedDataParallel(
        model, bucket_cap_mb=bucket_cap_mb)
    params = list(model.parameters())
    optimizer, lr_schedule, sampler = torch_training.training_setup(config, [model], make_optimizer)

    def microbatch(inputs, targets, last):
        # no_sync until the last microbatch: one all-reduce per step, as Interleaf's
        # REDUCE_GRADS after a chunk's last backward.
        with contextlib.nullcontext() if last else ddp.no_sync():
            loss = ddp(inputs, targets)
            (loss / p.microbatches).backward()
        return loss

    # After DDP's all-reduce every replica holds the same averaged gradient: the global
    # norm is the local one.
    result = data_parallel.train_steps(rank, config, microbatch, lambda: [q.grad for q in params], False,
                                       optimizer, lr_schedule, sampler)
    return {**result, "state_bytes": memory.state_bytes(params, optimizer_state(optimizer))}
