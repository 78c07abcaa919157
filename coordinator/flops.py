"""Model FLOPs per token, for model FLOPs utilization (MFU).

PaLM's accounting (Chowdhery et al. 2022, appendix B): 6 FLOPs per matrix parameter per
token (2 forward, 4 backward) plus the attention scores and their weighted sum,
12 * n_layers * d_model * seq_len, counted without the causal mask's saving. Matrix
parameters are the blocks' 12 * d_model^2 per layer and the tied head's vocab * d_model
(its matmul is real work even though its weight is the embedding's). Biases, norms and
the embedding lookup are not matrix work and are left out. Recomputation is not counted:
this is what the model needs, not what the hardware did.
"""

from __future__ import annotations


def matrix_parameters(n_layers: int, d_model: int, vocab_size: int) -> int:
    return 12 * n_layers * d_model * d_model + vocab_size * d_model


def flops_per_token(n_layers: int, d_model: int, vocab_size: int, seq_len: int) -> int:
    return 6 * matrix_parameters(n_layers, d_model, vocab_size) + 12 * n_layers * d_model * seq_len
