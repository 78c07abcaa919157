"""The learning rate of each step: linear warmup, then one of four decays to a floor.

A pure function of the step, so every rank, the single-process reference and a resumed
run compute the same rate with no state to carry (a checkpoint only records the step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("cosine", "linear", "wsd", "constant")
MIN_LR_RATIO = 0.1
"""The floor as a fraction of the peak: GPT-3's and nanoGPT's lr/10."""
DECAY_FRACTION = 0.2
"""WSD's decay phase by default: the last 20% of the steps (Hägele et al. 2024, §3)."""


@dataclass(frozen=True)
class Schedule:
    """`lr_at(step)` for step = 0, 1, ..., steps - 1.

    Warmup: steps 0..warmup_steps-1 climb linearly to the peak, lr*(step+1)/warmup_steps.
    Then, with floor = lr*min_lr_ratio and progress p running from 0 to 1 between the
    step the decay starts from and the last step:
      cosine    floor + (lr - floor) * (1 + cos(pi*p))/2, from the end of warmup (GPT-3);
      linear    floor + (lr - floor) * (1 - p), from the end of warmup;
      wsd       the peak held until the last round(decay_fraction*steps) steps, which
                fall linearly to the floor (warmup-stable-decay, torchtitan's WSD);
      constant  the peak to the end.
    cosine, linear and wsd reach exactly the floor at the last step, provided the warmup
    ends before it.

    Worked example, lr=1e-3, steps=8, warmup_steps=2, min_lr_ratio=0.2, wsd with
    decay_fraction=0.5 (the last 4 steps decay, so the decay starts from step 3):
        step  0     1     2     3     4     5     6     7
        lr    5e-4  1e-3  1e-3  1e-3  8e-4  6e-4  4e-4  2e-4
    """

    lr: float
    warmup_steps: int
    steps: int
    decay: str = "cosine"
    min_lr_ratio: float = MIN_LR_RATIO
    decay_fraction: float = DECAY_FRACTION

    def __post_init__(self):
        # The config layer validates with field names (coordinator/config/train.py);
        # this guards direct callers.
        if self.decay not in DECAYS:
            raise ValueError(f"decay={self.decay!r} must be one of {', '.join(DECAYS)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio={self.min_lr_ratio} must be between 0 and 1")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be more than 0 and at most 1")

    @classmethod
    def of(cls, train) -> Schedule:
        """The schedule a job's train settings name: a TrainConfig, a TrainPlan or a
        TrainSpec (its lr_decay empty from a coordinator that predates the choice)."""
        return cls(train.lr, train.warmup_steps, train.steps, train.lr_decay or "cosine",
                   train.min_lr_ratio, train.decay_fraction)

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        start = self.decay_start()
        span = max(1, self.steps - 1 - start)
        progress = min(1.0, max(0.0, (step - start) / span))
        floor = self.lr * self.min_lr_ratio
        if self.decay == "cosine":
            return floor + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - floor)
        return floor + (1.0 - progress) * (self.lr - floor)

    def decay_start(self) -> int:
        """The last step at the peak, from which the decay's progress counts. WSD's decay
        covers at least the last step and never reaches into the warmup."""
        if self.decay != "wsd":
            return self.warmup_steps
        decaying = max(1, round(self.decay_fraction * self.steps))
        return max(self.warmup_steps, self.steps - 1 - decaying)
