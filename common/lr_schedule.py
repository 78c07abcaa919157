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
      wsd       the peak held, then the last D steps fall linearly to the floor
                (warmup-stable-decay, torchtitan's WSD), where D is decay_fraction*steps
                rounded half up, at least 1 and at most steps-1-warmup_steps: the decay
                starts from a step at the peak, never inside the warmup, so
                decay_fraction=1 is the linear decay;
      constant  the peak to the end.
    Past the last step (a longer resumed job) the rate stays where it ended.

    The edges, exactly (no config rule forbids them; tests run steps=3 under the default
    warmup_steps=20):
    - warmup_steps <= steps - 2: cosine, linear and wsd reach exactly the floor at the
      last step. With a warmup the peak is reached twice: at the warmup's last step
      (lr*warmup_steps/warmup_steps) and at step warmup_steps, where progress is 0.
    - warmup_steps = steps - 1 (steps = 1 with no warmup among them): step
      warmup_steps, where the decay would start, is the last step; it trains at the
      peak and no step decays, whatever the decay.
    - warmup_steps >= steps: every step warms up, lr*(step+1)/warmup_steps; the peak
      is reached only when warmup_steps = steps (at the last step), never when more.

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
        TrainSpec (whose lr_decay the server's setup checks have found set)."""
        return cls(train.lr, train.warmup_steps, train.steps, train.lr_decay,
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
        return max(self.warmup_steps, self.steps - 1 - self.wsd_decay_steps())

    def wsd_decay_steps(self) -> int:
        """WSD's D before the warmup caps it: decay_fraction*steps rounded half up (not
        Python's round, which rounds 2.5 to 2), at least 1. The 1e-9 absorbs the binary
        error of a product meant to be a half (0.7*45 = 31.499999999999996: D = 32)."""
        return max(1, math.floor(self.decay_fraction * self.steps + 0.5 + 1e-9))
