"""The optimizer side of the torch peers, kept arithmetically identical to Interleaf's
(stageserver/optim.py), so that peer and Interleaf losses agree step by step and the
benchmark compares the same computation.

torch.optim.AdamW with Interleaf's betas and eps, weight decay on exactly the parameters
Interleaf decays, its learning-rate schedule, and clipping by the global norm the way
Interleaf counts it (float64 sum of squares, each element of the model once).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from interleaf.common.lr_schedule import Schedule
from interleaf.coordinator.config import JobConfig
from interleaf.stageserver.data import Sampler, resolve_source
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.optim import BETAS, EPS, clip_coefficient


def param_groups(chunks: list[ModelChunk], weight_decay: float) -> list[dict]:
    """Interleaf's two groups: decayed (matrices, embeddings) and not (biases, norms).
    Names are read after any wrapping (fully_shard keeps them), so the parameters
    grouped are the ones the optimizer will see."""
    decay, plain = [], []
    for chunk in chunks:
        specs = chunk.param_specs()
        for name, param in chunk.named_parameters():
            (decay if specs[name].weight_decay else plain).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": plain, "weight_decay": 0.0}]


def adamw(chunks: list[ModelChunk], weight_decay: float) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(chunks, weight_decay), lr=0.0, betas=BETAS, eps=EPS)


def clip_global_norm(grads: list[torch.Tensor], counted: list[torch.Tensor], max_norm: float,
                     across_ranks: bool) -> None:
    """Scales `grads` in place so that the global norm is at most max_norm. The norm
    counts `counted` only (a rank's copy of the tied embedding that another rank also
    holds is scaled, not counted; a shard counts only its own elements); with
    across_ranks, the sum of squares is all-reduced over the default group first."""
    sumsq = torch.zeros(1, dtype=torch.float64)
    for grad in counted:
        sumsq += grad.double().square().sum()
    if across_ranks:
        dist.all_reduce(sumsq)
    norm = float(sumsq.sqrt())
    coefficient = clip_coefficient(norm, max_norm)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)


def step(optimizer: torch.optim.AdamW, schedule: Schedule, step_index: int) -> None:
    lr = schedule.lr_at(step_index)
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()


def training_setup(config: JobConfig, chunks: list[ModelChunk], optimizer=adamw):
    """The peer's optimizer (`optimizer(chunks, weight_decay)`), learning-rate schedule
    and sampler, matched to Interleaf's."""
    m, p, t = config.model, config.parallel, config.train
    return (
        optimizer(chunks, t.weight_decay),
        Schedule.of(t),
        Sampler(resolve_source(config.data.source), t.seed, m.seq_len, t.global_batch, p.microbatches),
    )
