"""Model FLOPs per token, for model FLOPs utilization (MFU).

PaLM's accounting (Chowdhery et al. 2022, appendix B): 6 FLOPs per matrix parameter per
token (2 forward, 4 backward) plus the attention scores and their weighted sum,
12 * n_layers * d_model * seq_len, counted without the causal mask's saving (grouped-query
attention scores every query head, so the term is the same for it). Matrix parameters are
the blocks' weights that multiply activations, as each architecture declares them
(`block_parameters`): GPT-2's qkv, proj, up and down (12 * d_model^2 at the default
ffn_hidden of 4 * d_model); Llama's q and proj (d_model^2 each), k and v
(n_kv_heads * head_dim * d_model each, smaller under grouped-query attention) and SwiGLU's
gate, up and down (3 * ffn_hidden * d_model). Then the head's padded vocabulary times
d_model, tied or not: its matmul is real work even when its weight is the embedding's,
and the padding rows are multiplied too. Padded to pad_vocab_to, as the model is on one
tensor rank; the further rows that tp ranks add, like recomputation, are the layout's
work, not the model's, so every layout of one model counts the same FLOPs. Biases, norms,
rotary embeddings and the embedding lookup are not matrix work and are left out.

Worked examples: the 1.11B GPT-2 benchmark model (20 layers, d_model 2048, vocabulary
50304, seq_len 2048) does 6 * 1,109,655,552 + 12 * 20 * 2048 * 2048 = 7,664,566,272 FLOPs
per token; Llama-2 7B (32 layers, d_model 4096, 32 heads and key/value heads, ffn_hidden
11008, vocabulary 32000, untied, seq_len 4096) 6 * 6,607,077,376 + 12 * 32 * 4096 * 4096
= 46,084,915,200.
"""

from __future__ import annotations

import math

from interleaf.common.model.architectures import architecture
from interleaf.common.model.config import shape_of


def matrix_parameters(model) -> int:
    """Weights per model that multiply activations; `model` has ModelShape's fields
    (a job's `[model]` section, a ModelShape)."""
    shape = shape_of(model)
    block = architecture(shape.arch).block_parameters(shape)
    per_layer = sum(math.prod(full) for full, _ in block.values() if len(full) == 2)
    return shape.n_layers * per_layer + shape.padded_vocab(1) * shape.d_model


def flops_per_token(model) -> int:
    """Model FLOPs of one token's forward and backward; `model` as matrix_parameters'."""
    return 6 * matrix_parameters(model) + 12 * model.n_layers * model.d_model * model.seq_len


def utilization(model, tokens: int, step_seconds: float, peak_flops: list[float]) -> float | None:
    """Model FLOPs utilization of a step: its model FLOPs over step time x the summed peak
    FLOP/s of the job's servers (each one's --peak-flops); None when a peak is unknown."""
    if not peak_flops or min(peak_flops) <= 0 or step_seconds <= 0:
        return None
    return flops_per_token(model) * tokens / (step_seconds * sum(peak_flops))
