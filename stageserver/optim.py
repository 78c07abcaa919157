"""AdamW over flat buffers, the learning-rate schedule and global-norm clipping.

Elementwise, so any split of the parameters (pipeline chunks, tensor shards, ZeRO
shards) updates each element exactly as the single-process reference does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BETAS = (0.9, 0.95)
EPS = 1e-8
MIN_LR_RATIO = 0.1
SLICE = 1 << 16
"""Elements per slice of the flat buffers: every elementwise pass over a slice finds it
in cache, where whole-buffer passes would stream it from memory once per operation."""


def squared_norm(tensor: torch.Tensor) -> float:
    """Sum of squares in float64, one cache-sized slice at a time: the precision of a
    double sum without a full-size double copy of the gradients."""
    total = 0.0
    for part in tensor.reshape(-1).split(SLICE):
        wide = part.double()
        total += float(torch.dot(wide, wide))
    return total


@dataclass(frozen=True)
class Schedule:
    lr: float
    warmup_steps: int
    steps: int

    def lr_at(self, step: int) -> float:
        """Linear warmup to lr over warmup_steps, then cosine decay to lr/10 at the end
        (GPT-3 / nanoGPT). `step` counts from 0."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        span = max(1, self.steps - 1 - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        floor = self.lr * MIN_LR_RATIO
        return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - floor)


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor; max_norm 0 disables clipping."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


class AdamW:
    """Decoupled weight decay (Loshchilov & Hutter), torch.optim.AdamW's arithmetic.

    `params` is a flat buffer (a whole bucket, or a ZeRO shard of one) and
    `decay_segments` the [start, end) ranges of it that are decayed."""

    def __init__(self, params: torch.Tensor, decay_segments: list[tuple[int, int]], weight_decay: float):
        self.params = params
        self.decay_segments = list(decay_segments)
        self.weight_decay = weight_decay
        self.exp_avg = torch.zeros_like(params)
        self.exp_avg_sq = torch.zeros_like(params)
        self.steps = 0

    @property
    def state_bytes(self) -> int:
        return 2 * self.params.numel() * self.params.element_size()

    def step(self, grad: torch.Tensor, lr: float) -> None:
        self.steps += 1
        beta1, beta2 = BETAS
        bias1 = 1.0 - beta1**self.steps
        bias2_sqrt = math.sqrt(1.0 - beta2**self.steps)
        # Decay first: per element the same p*(1 - lr*wd) before the update as in torch.
        for start, end in self.decay_segments:
            for part in self.params[start:end].split(SLICE):
                part.mul_(1.0 - lr * self.weight_decay)
        parts = zip(*(t.split(SLICE) for t in (self.params, grad, self.exp_avg, self.exp_avg_sq)))
        for params, g, exp_avg, exp_avg_sq in parts:
            exp_avg.lerp_(g, 1.0 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
            denom = (exp_avg_sq.sqrt() / bias2_sqrt).add_(EPS)
            params.addcdiv_(exp_avg, denom, value=-lr / bias1)
