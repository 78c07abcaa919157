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

from coordinator.config import JobConfig
from stageserver.data import Sampler, resolve_source
from stageserver.flat import FlatParams
from stageserver.model import GPTConfig, full_model
from stageserver.optim import AdamW, Schedule, clip_coefficient, squared_norm


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
    model = full_model(GPTConfig(m.n_layers, m.d_model, m.n_heads, m.seq_len, m.vocab_size), t.seed)
    specs = model.param_specs()
    flat = FlatParams(model, {name: spec.weight_decay for name, spec in specs.items()})
    optimizer = AdamW(flat.data, flat.decay_mask, t.weight_decay)
    schedule = Schedule(t.lr, t.warmup_steps, t.steps)
    sampler = Sampler(resolve_source(config.data.source), t.seed, m.seq_len, t.global_batch // microbatches)
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
        norm = math.sqrt(squared_norm(flat.grad))
        coefficient = clip_coefficient(norm, t.grad_clip)
        if coefficient < 1.0:
            flat.grad.mul_(coefficient)
        lr = schedule.lr_at(step)
        optimizer.step(flat.grad, lr)
        record = ReferenceStep(step, sum(losses) / len(losses), t.global_batch * m.seq_len,
                               time.perf_counter() - started, norm, lr)
        history.append(record)
        if on_step:
            on_step(record)
    return history, {name: p.detach().clone() for name, p in model.named_parameters()}
