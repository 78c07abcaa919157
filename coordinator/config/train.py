"""[train]: steps, batch, optimizer, schedule, precision and recompute."""

from __future__ import annotations

from dataclasses import dataclass

from interleaf.coordinator.config.rules import ConfigError, _bounded, _positive

PRECISION_BYTES = {"fp32": 4, "bf16": 2, "fp64": 8}
"""Bytes per element of the compute dtype of each train.precision."""
MASTER_BYTES = {"fp32": 4, "bf16": 4, "fp64": 8}
"""Bytes per element of the master weights, Adam moments and gradient reductions."""
PRECISIONS = tuple(PRECISION_BYTES)
RECOMPUTE = ("none", "full")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    """Optimizer steps."""
    global_batch: int = 16
    """Samples per step over all replicas; divisible by parallel.dp * parallel.microbatches."""
    lr: float = 3e-3
    """Peak learning rate (AdamW, betas 0.9/0.95)."""
    warmup_steps: int = 20
    """Linear warmup steps; then cosine decay to lr/10 at the last step."""
    weight_decay: float = 0.1
    """Decoupled weight decay on weights and embeddings (not biases or norms)."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over all ranks) to this; 0 turns clipping off."""
    seed: int = 1234
    """Seeds the initial weights and the sample order."""
    precision: str = "fp32"
    """fp32; bf16 (bf16 parameters, activations and gradients for compute, fp32 master
    weights, Adam moments and gradient reductions, softmax and loss in fp32); or fp64
    (everything float64: the verification mode, with no rounding noise to hide a bug)."""
    recompute: str = "none"
    """none, or full: a chunk keeps only its input after a forward and recomputes its
    activations in the backward (less activation memory for a second forward)."""

    def __post_init__(self):
        _positive("train", self, "steps", "global_batch")
        _bounded("train", self)
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision={self.precision!r} must be one of {', '.join(PRECISIONS)}")
        if self.recompute not in RECOMPUTE:
            raise ConfigError(f"train.recompute={self.recompute!r} must be one of {', '.join(RECOMPUTE)}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr={self.lr} must be greater than 0")
        for name in ("warmup_steps", "weight_decay", "grad_clip", "seed"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}={getattr(self, name)} must not be negative")
