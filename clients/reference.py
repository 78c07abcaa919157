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

from interleaf.clients.api import Evaluation
from interleaf.common.buckets import BucketLayout
from interleaf.common.lr_schedule import Schedule
from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import JobConfig, eval_points
from interleaf.coordinator.evaluations import perplexity
from interleaf.stageserver.data import Sampler, resolve_source
from interleaf.stageserver.data.holdout import EvalSet, open_eval_set, training_data
from interleaf.stageserver.init_weights import initial_values
from interleaf.stageserver.memory import MemoryLedger
from interleaf.stageserver.model import full_model
from interleaf.stageserver.model.fp8 import convert_blocks_to_fp8
from interleaf.stageserver.model_state import DTYPES, MASTER_DTYPES
from interleaf.stageserver.optim import clip_coefficient, squared_norm
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


def evaluate(model, eval_set: EvalSet, step: int, rows: int, seq_len: int) -> Evaluation:
    """The mean next-token loss over the evaluation set, scored in microbatches of the
    training microbatch's rows as the servers score it (stageserver/evaluation.py)."""
    started = time.perf_counter()
    losses = []
    with torch.no_grad():
        for microbatch in range(eval_set.samples // rows):
            inputs, targets = eval_set.microbatch(microbatch, rows)
            losses.append(model(inputs, targets).item())
    loss = sum(losses) / len(losses)
    return Evaluation(step, loss, perplexity(loss), eval_set.samples, eval_set.samples * seq_len,
                         time.perf_counter() - started)


def train(config: JobConfig, on_step=None, on_eval=None) -> tuple[list[ReferenceStep], dict[str, torch.Tensor]]:
    """`on_step(ReferenceStep)` after every step; `on_eval(Evaluation)` after each
    evaluation ([eval]: at the job's own eval_points, on the servers' very samples)."""
    m, t, microbatches = config.model, config.train, config.parallel.microbatches
    shape = shape_of(m)
    # checkpoint.init (resolved where the config was built): the weights every server starts from.
    initial = initial_values(config.checkpoint.init, shape) if config.checkpoint.init else None
    model = full_model(shape, t.seed, initial)
    if t.precision == "fp8":  # the servers' float8 products, emulated on this CPU
        convert_blocks_to_fp8(model, t.fp8_recipe, torch.device("cpu"))
    specs = model.param_specs()
    named = list(model.named_parameters())
    dtype = DTYPES[t.precision]
    # The whole model in one bucket on a data-parallel group of one: stage 0, no padding.
    flat = ShardedBucket(named, BucketLayout.build([(n, p.numel()) for n, p in named], 1, 0), 0,
                         dtype, MASTER_DTYPES[dtype], SoloTransport(), MemoryLedger(),
                         {n for n in specs if specs[n].weight_decay}, t.weight_decay,
                         betas=t.betas, eps=t.eps)
    schedule = Schedule.of(t)
    # The servers' split and set (stageserver/data/holdout.py).
    source, e, eval_set = resolve_source(config.data.source), config.eval, None
    data = training_data(source, e.held_out)
    if e.enabled:
        eval_set = open_eval_set(source, e.source, e.held_out, m.seq_len, e.samples)
    scored = set(eval_points(config.eval.every, t.steps))
    sampler = Sampler(data, t.seed, m.seq_len, t.global_batch, microbatches)
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
        if step + 1 in scored:
            evaluation = evaluate(model, eval_set, step + 1, t.global_batch // microbatches, m.seq_len)
            if on_eval:
                on_eval(evaluation)
    return history, {name: p.clone() for name, p in model.unpadded_parameters().items()}
