"""Predicted activation bytes one (chunk, microbatch) keeps between its forward and its
backward, per tp rank: what stageserver/activation_meter.py measures, exactly.

Counted the way Korthikanti et al. 2022 (section 4.1) count sbh(34 + 5as/h), but tensor
by tensor for this model on torch 2.13's CPU kernels, and by distinct storage, so what
several saved tensors share counts once: q, k and v are three views of one qkv output;
proj saves a view of the attention output; a block's output is the next block's ln_1
input; the token ids and targets are views of one sampler window.
Notation: b rows, s tokens, d d_model, t tp, a the compute dtype's bytes; f is the
float32 floor the kernels keep for softmax statistics (4 for bf16, else a).

Per transformer block, per tp rank:
    b*s*d*a*(4 + 12/t)   hidden states and the sharded qkv/attention/MLP activations
  + 4*b*s*a             the two LayerNorms' mean and rstd
  + b*(n_heads/t)*s*f   the attention's logsumexp
No s^2 term: CPU scaled_dot_product_attention is the flash kernel, which saves only
q, k, v, its output and the logsumexp, not the attention matrix (nor, without dropout, a
mask). Parameters are excluded (the memory model counts them as parameters).
"""

from __future__ import annotations

from interleaf.coordinator.config import PRECISION_BYTES as _BYTES

_INT64 = 8
_BOOL = 1


def _dtype_bytes(precision: str) -> tuple[int, int]:
    """(compute dtype bytes, bytes of what the kernels keep in at least float32)."""
    if precision not in _BYTES:
        raise ValueError(f"precision={precision!r} must be one of {', '.join(_BYTES)}")
    a = _BYTES[precision]
    return a, max(a, 4)


def token_window_bytes(seq_len: int, rows: int) -> int:
    """The sampler's [rows, seq_len+1] int64 window, of which a microbatch's inputs and
    targets are two overlapping views: holding either keeps all of it."""
    return rows * (seq_len + 1) * _INT64


def block_activation_bytes(
    d_model: int, n_heads: int, seq_len: int, rows: int, tp: int, precision: str
) -> int:
    """What one transformer block saves for its backward, on one tp rank."""
    a, f = _dtype_bytes(precision)
    bs, d_t = rows * seq_len, d_model // tp
    return (
        bs * d_model * a  # ln_1 input: the block's input (the residual stream)
        + 2 * bs * a  # ln_1 mean and rstd (the compute dtype on CPU, even bf16)
        + bs * d_model * a  # ln_1 output: the qkv matmul's input (replicated over tp)
        + bs * 3 * d_t * a  # qkv output; SDPA saves q, k, v as three views of it
        + bs * d_t * a  # SDPA output, [b, s, h, hd] in memory: proj saves it as a view
        + rows * (n_heads // tp) * seq_len * f  # SDPA logsumexp [b, h/t, s], float32 for bf16
        + bs * d_model * a  # ln_2 input: x + attn (the residual after attention)
        + 2 * bs * a  # ln_2 mean and rstd
        + bs * d_model * a  # ln_2 output: the up matmul's input
        + bs * 4 * d_t * a  # up output: GELU(tanh)'s input
        + bs * 4 * d_t * a  # GELU output: the down matmul's input
    )  # the block's output is the next block's ln_1 input, or the chunk's output / ln_f input


def chunk_activation_bytes(
    d_model: int,
    n_heads: int,
    seq_len: int,
    vocab_size: int,
    layers: int,
    has_embedding: bool,
    has_head: bool,
    rows: int,
    tp: int,
    precision: str,
) -> int:
    """Bytes one tp rank keeps from a chunk's forward of `rows` samples of `seq_len`
    tokens until its backward (recompute=none), counting the chunk's input and output.
    Also the transient peak of saved activations while recompute=full reruns the forward
    in the backward."""
    a, f = _dtype_bytes(precision)
    bs = rows * seq_len
    total = layers * block_activation_bytes(d_model, n_heads, seq_len, rows, tp, precision)
    # The last hidden states: the chunk's output, or the head's ln_f input. (Without an
    # embedding, the first block's input is x itself, already counted in the blocks.)
    total += bs * d_model * a
    if has_embedding:
        total += (
            token_window_bytes(seq_len, rows)  # x: the token ids, a view of the window
            + bs * _INT64  # the ids local to this rank's vocab slice (embedding's indices)
            + bs * _BOOL  # which ids are outside that slice (masked_fill's mask)
            + seq_len * _INT64  # the positions 0..s-1 (position embedding's indices)
        )
    if has_head:
        total += (
            2 * bs * a  # ln_f mean and rstd
            + bs * d_model * a  # ln_f output: the head matmul's input
            + bs * (vocab_size // tp) * f  # vocab-parallel softmax, float32 for bf16
            + bs * _INT64  # targets local to this rank's vocab slice
            + bs * _BOOL  # which targets are outside that slice
            + f  # out: the scalar loss, float32 for bf16
        )  # the logits themselves are not kept: the cross-entropy saves only the softmax
    return total


def chunk_input_bytes(
    d_model: int, seq_len: int, has_embedding: bool, rows: int, precision: str
) -> int:
    """Bytes one tp rank keeps from a chunk's forward until its backward with
    recompute=full: only the input, token ids for the chunk with the embedding (the head
    chunk's targets are read again, not kept), else hidden states [rows, seq, d_model]."""
    if has_embedding:
        return token_window_bytes(seq_len, rows)
    a, _ = _dtype_bytes(precision)
    return rows * seq_len * d_model * a
