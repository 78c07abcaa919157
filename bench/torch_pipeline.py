"""The pipeline peer: torch.distributed.pipelining running the same model chunks, split
the same way (coordinator/partition.py), on the same microbatches, with the same
optimizer step as an Interleaf pipeline job.

Runs on every rank of a peer_world; returns that rank's per-step wall times and
resident-set peaks and, on the rank holding the head, the per-step mean losses. Any of
torch's schedules may run a job's layout (`peer`: Interleaf's counterpart by default),
its zero-bubble ones included, which split each backward into its input- and
weight-gradient halves by walking the autograd graph (torch's pipelining/_backward.py).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class

from interleaf.common.model.config import shape_of
from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.partition import chunks_of, partition
from interleaf.stageserver.model import ModelChunk
from interleaf.stageserver.transport import SoloTransport

# Siblings in bench/.
import torch_training
from live_activations import LiveActivations, Metered
from memory import peak_rss_bytes, reset_peak

SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}
"""Interleaf's schedule -> torch's counterpart, by the name get_schedule_class takes."""


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


def train(rank: int, config: JobConfig, peer: str | None = None, meter: bool = False) -> dict:
    """`peer`: torch's schedule (get_schedule_class's name), with p.vpp stages per rank;
    ZBVZeroBubble's in torch's V (rank r: stages r and 2p-1-r, Interleaf's zbv
    placement), every other one's round-robin. `meter`: after the timed steps, one more
    forward and backward of the last step's batch, untimed and with its gradients
    dropped, counts the activation bytes alive at once (live_activations.py)."""
    m, p, t = config.model, config.parallel, config.train
    if p.pp != 2 or dist.get_world_size() != 2 or p.dp != 1 or p.tp != 1:
        raise ValueError("the pipeline peer runs pp=2, dp=tp=1 on 2 processes")
    kind = get_schedule_class(peer or SCHEDULES[p.schedule])
    shape = shape_of(m)
    placement = "zbv" if kind is ScheduleZBVZeroBubble else "interleaved-1f1b"
    held = chunks_of(partition(m.n_layers, p.pp, p.vpp, placement), rank)
    chunks = [ModelChunk(shape, c.layers, c.has_embedding, c.has_head, SoloTransport(), t.seed) for c in held]
    live = LiveActivations(frozenset(q.untyped_storage().data_ptr() for chunk in chunks for q in chunk.parameters()))
    modules = [LogitsHead(chunk) if c.has_head else chunk for c, chunk in zip(held, chunks)]
    stages = [PipelineStage(Metered(module, live) if meter else module, c.index, p.pp * p.vpp, torch.device("cpu"))
              for c, module in zip(held, modules)]
    held_stages = stages if issubclass(kind, PipelineScheduleMulti) else stages[0]
    schedule = kind(held_stages, p.microbatches, loss_fn=cross_entropy)

    # Tied embeddings (gpt2's default): the embedding (first chunk) and the head (last
    # chunk) each hold a copy of the tied weight, as in Interleaf. Round-robin at pp=2
    # they are on ranks 0 and 1, and one all-reduce over the world sums their gradients;
    # in a V both are on rank 0, which sums them itself. The norm counts the first's.
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

    def forward_backward(step: int) -> list | None:
        # The schedule splits the batch along dim 0 into microbatches of `rows`: the
        # concatenation of Interleaf's microbatches, so each one holds the same samples.
        parts = [sampler.microbatch(step, mb) for mb in range(p.microbatches)]
        inputs = torch.cat([x for x, _ in parts])
        targets = torch.cat([y for _, y in parts])
        losses = [] if last else None
        schedule.step(*((inputs,) if first else ()), target=targets if last else None,
                      losses=losses, return_outputs=False)
        return losses

    times, history, rss = [], [], []
    for step in range(t.steps):
        reset_peak()
        started = time.perf_counter()
        optimizer.zero_grad()
        losses = forward_backward(step)
        tied_grads = [weight.grad for weight in tied if weight.grad is not None]
        if len(tied_grads) == 2:
            total = tied_grads[0] + tied_grads[1]
            for grad in tied_grads:
                grad.copy_(total)
        elif tied_grads:
            dist.all_reduce(tied_grads[0])
        torch_training.clip_global_norm([q.grad for q in params], [q.grad for q in counted], t.grad_clip,
                                        across_ranks=True)
        torch_training.step(optimizer, lr_schedule, step)
        times.append(time.perf_counter() - started)
        rss.append(peak_rss_bytes())
        if losses is not None:
            history.append(float(torch.stack(losses).detach().mean()))
    result: dict = {"step_seconds": times, "losses": history if last else None, "rss_peak_bytes": rss}
    if meter:
        with live.counting():
            forward_backward(t.steps - 1)
        optimizer.zero_grad()
        result["activations_peak_bytes"] = live.peak
    return result
