"""`interleaf reference`: the same training run in one process, no parallelism.

Same model and initialization, same samples in the same order, same optimizer and
schedule; microbatches are accumulated as the pipeline does. Every parallel layout
must reproduce its losses and final parameters (DESIGN.md, "The equivalence contract").
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from interleaf.coordinator.config import JobConfig
from interleaf.stageserver.data import Sampler, resolve_source
from interleaf.stageserver.buckets import BucketLayout
from interleaf.stageserver.init_weights import initial_values
from interleaf.stageserver.memory import MemoryLedger
from interleaf.stageserver.model import full_model, shape_of
from interleaf.stageserver.model_state import DTYPES, MASTER_DTYPES
from interleaf.stageserver.optim import Schedule, clip_coefficient, squared_norm
from interleaf.stageserver.sharded_bucket import ShardedBucket
from interleaf.stageserver.transport import SoloTransport


@dataclass
class ReferenceStep:
    step: int
    loss: float
    tokens: int
    step_seconds: float
    grad_norm: float
    lr: float


def train(config: JobConfig, on_step=None) -> tuple[list[ReferenceStep], dict[str, torch.Tensor]]:
    m, t, microbatches = config.model, config.train, config.parallel.microbatches
    shape = shape_of(m)
    # checkpoint.init (resolved where the config was built): the weights every server starts from.
    initial = initial_values(config.checkpoint.init, shape) if config.checkpoint.init else None
    model = full_model(shape, t.seed, initial)
    specs = model.param_specs()
    named = list(model.named_parameters())
    dtype = DTYPES[t.precision]
    # The whole model in one bucket on a data-parallel group of one: stage 0, no padding.
    flat = ShardedBucket(named, BucketLayout.build([(n, p.numel()) for n, p in named], 1, 0), 0,
                         dtype, MASTER_DTYPES[dtype], SoloTransport(), MemoryLedger(),
                         {n for n in specs if specs[n].weight_decay}, t.weight_decay)
    schedule = Schedule(t.lr, t.warmup_steps, t.steps)
    sampler = Sampler(resolve_source(config.data.source), t.seed, m.seq_len, t.global_batch, microbatches)
    history = []
    for step in range(t.steps):
        started = time.perf_counter()
        flat.zero_grad()
        losses = []
        for microbatch in range(microbatches):
            inputs, targets = sampler.microbatch(step, microbatch)
            loss = model(inputs, targets)
            (loss / microbatches).backward()
            losses.append(loss.item())
        norm = math.sqrt(squared_norm(flat.optimizer_grad()))
        lr = schedule.lr_at(step)
        flat.step(lr, clip_coefficient(norm, t.grad_clip))
        record = ReferenceStep(step, sum(losses) / len(losses), t.global_batch * m.seq_len,
                               time.perf_counter() - started, norm, lr)
        history.append(record)
        if on_step:
            on_step(record)
    return history, {name: p.clone() for name, p in model.unpadded_parameters().items()}
