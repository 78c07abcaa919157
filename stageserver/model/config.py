"""The model's shape, as the stage server receives it (see protos: ModelSpec)."""

from __future__ import annotations

from dataclasses import dataclass

INIT_STD = 0.02
"""GPT-2's initializer scale; residual output projections use INIT_STD/sqrt(2*n_layers)."""


@dataclass(frozen=True)
class GPTConfig:
    n_layers: int
    """Transformer blocks in the whole (unsplit) model."""
    d_model: int
    """Hidden size."""
    n_heads: int
    """Attention heads; d_model // n_heads is the head size."""
    seq_len: int
    """Tokens per sample; also the number of learned positions."""
    vocab_size: int
    """Token ids are in [0, vocab_size)."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads
