"""The pipeline peer: torch.distributed.pipelining running the same model chunks, split
the same way (coordinator/partition.py), on the same microbatches, with the same
optimizer step as an Interleaf pipeline job.

Runs on every rank of a peer_world; returns that rank's per-step wall times and, on the
rank holding the head, the per-step mean losses.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.partition import chunks_of, partition
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.transport import SoloTransport

import torch_training  # sibling in bench/

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}


class LogitsHead(nn.Module):
    """The last chunk returning logits instead of the loss: torch's schedules compute the
    loss themselves, from the last stage's output and the target, with loss_fn. The
    compute is ModelChunk.forward's with the cross-entropy moved into loss_fn; the logits
    of a padded vocabulary's padding rows are cut off, as they never enter Interleaf's
    softmax."""

    def __init__(self, chunk: ModelChunk):
        super().__init__()
        self.chunk = chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.chunk.h.values():
            x = block(x)
        logits = F.linear(self.chunk.ln_f(x), self.chunk.head_weight())
        return logits[..., :self.chunk.config.vocab_size]


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def train(rank: int, config: JobConfig) -> dict:
    m, p, t = config.model, config.parallel, config.train
    if p.pp != 2 or dist.get_world_size() != 2 or p.dp != 1 or p.tp != 1:
        raise ValueError("the pipeline peer runs pp=2, dp=tp=1 on 2 processes")
    shape = shape_of(m)
    held = chunks_of(partition(m.n_layers, p.pp, p.vpp, p.schedule), rank)
    chunks = [ModelChunk(shape, c.layers, c.has_embedding, c.has_head, SoloTransport(), t.seed) for c in held]
    stages = [
        PipelineStage(LogitsHead(chunk) if c.has_head else chunk, c.index, p.pp * p.vpp, torch.device("cpu"))
        for c, chunk in zip(held, chunks)
    ]
    kind = SCHEDULES[p.schedule]
    held_stages = stages if issubclass(kind, PipelineScheduleMulti) else stages[0]
    schedule = kind(held_stages, p.microbatches, loss_fn=cross_entropy)

    # Tied embeddings (gpt2's default): with pp=2 the embedding (first chunk, rank 0) and
    # the head (last chunk, rank 1) each hold a copy of the tied weight, as in Interleaf;
    # one all-reduce over the world sums their gradients, and the norm counts rank 0's.
    # Untied (llama's): `wte` on the first chunk and `lm_head` on the last, each held
    # once, so nothing is summed and every parameter counts.
    ends = [chunk for chunk in chunks if chunk.has_embedding or chunk.has_head] if m.tie_embeddings else []
    tied = [chunk.wte.weight for chunk in ends]
    params = [param for chunk in chunks for param in chunk.parameters()]
    head_copy = {id(chunk.wte.weight) for chunk in ends if not chunk.has_embedding}
    counted = [param for param in params if id(param) not in head_copy]
    first = any(c.has_embedding for c in held)
    last = any(c.has_head for c in held)

    optimizer, lr_schedule, sampler = torch_training.training_setup(config, chunks)
    times, history = [], []
    for step in range(t.steps):
        started = time.perf_counter()
        optimizer.zero_grad()
        # The schedule splits the batch along dim 0 into microbatches of `rows`: the
        # concatenation of Interleaf's microbatches, so each one holds the same samples.
        parts = [sampler.microbatch(step, mb) for mb in range(p.microbatches)]
        inputs = torch.cat([x for x, _ in parts])
        targets = torch.cat([y for _, y in parts])
        losses = [] if last else None
        schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                      losses=losses, return_outputs=False)
        for weight in tied:
            dist.all_reduce(weight.grad)
        torch_training.clip_global_norm([q.grad for q in params], [q.grad for q in counted], t.grad_clip,
                                        across_ranks=True)
        torch_training.step(optimizer, lr_schedule, step)
        times.append(time.perf_counter() - started)
        if last:
            history.append(float(torch.stack(losses).detach().mean()))
    return {"step_seconds": times, "losses": history if last else None}
