"""The ZeRO-3 peer: torch FSDP2 (`torch.distributed.fsdp.fully_shard`) on a CPU device
mesh over gloo. Parameters, gradients and Adam moments are sharded over the replicas
(dim-0 shards of every parameter, DTensors). Two ways to cut the model into FSDP units:

  per_block=True: each transformer block one unit and the root (embedding, learned
    positions if any, final norm, and the head: the tied embedding, or `lm_head` when
    untied) one more, as torchtitan wraps a model.
    A block's parameters are all-gathered before its forward and again before its
    backward, and freed after each: at most a block or two gathered at once, 2 x
    microbatches x blocks all-gathers a step, none overlapping compute on CPU (FSDP2's
    implicit prefetch overlaps through CUDA streams, which a CPU lacks; README.md).
    What a torch user would run.
  per_block=False: the whole model one unit, gathered before the first forward of the
    step and kept until the last backward (reshard after forward and after backward off
    until then): one all-gather a step, the whole model gathered through the step. What
    Interleaf's ZeRO-3 does with one chunk per rank (pp=1): a chunk's parameters are
    gathered for a run of consecutive computes on it, and with pp=1 that run is the step.

Gradient accumulation: on every microbatch but the last, gradient sync is off, so FSDP2
accumulates full-size unsharded gradients and reduce-scatters them once, after the last
microbatch's backward: one reduce-scatter per step, as DDP's one all-reduce and
Interleaf's reduction after a chunk's last backward. Clipping sums the squares of each
rank's gradient shards over the ranks (every element counted once: FSDP2's padding is
not in the local shards).

Runs on every rank of a peer_world; returns what data_parallel.train_steps does and the
training state this rank holds (its shards).
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import JobConfig
from interleaf.stageserver.model import full_model

import data_parallel  # siblings in bench/
import memory
import torch_training


def train(rank: int, config: JobConfig, per_block: bool = True) -> dict:
    m, p, t = config.model, config.parallel, config.train
    data_parallel.check_layout(config, "FSDP2")
    # Built whole from the seed on every rank, then sharded: the shards are slices of
    # the same initial weights every Interleaf layout starts from.
    model = full_model(shape_of(m), t.seed)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    if per_block:
        for block in model.h.values():
            fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh, reshard_after_forward=per_block)
    params = list(model.parameters())  # DTensors, each holding this rank's shard
    optimizer, lr_schedule, sampler = torch_training.training_setup(config, [model])

    def microbatch(inputs, targets, last):
        model.set_requires_gradient_sync(last)
        if not per_block:
            model.set_reshard_after_backward(last)
        loss = model(inputs, targets)
        (loss / p.microbatches).backward()
        return loss

    # to_local() is the shard itself, not a copy: clipping scales it in place.
    result = data_parallel.train_steps(rank, config, microbatch, lambda: [q.grad.to_local() for q in params], True,
                                       optimizer, lr_schedule, sampler)
    return {**result, "state_bytes": memory.state_bytes(params, optimizer.state)}
