"""How many tokens the fused head loss (stageserver/model/fused_loss.py) takes at a time:
shared with the memory model, which counts one chunk's temporaries
(coordinator/activation_bytes.py, head_loss_temporaries_bytes).

Worked example: vocabulary 50304 at t=1 in bf16 (its softmax in float32, 4 bytes):
2**28 // (50304 * 4) = 1334 tokens, rounded down to whole tiles of 128 rows, 1280. In
float64, 640; with 2**22 columns only 16 fit, fewer than a tile: 16.
"""

from __future__ import annotations

CHUNK_BYTES = 256 * 2**20
"""The most one chunk's float32 (float64) softmax may take: the bound on the loss's
[tokens x V/t] temporaries (a chunk has about two of that size at once; beside them
the forward holds the head's [V/t x d] gradient, summed in float32, and one chunk's
share of it: see fused_loss.py's worked example)."""
ROWS_ALIGN = 128
"""Chunks of whole 128-row tiles: the tensor cores' products run in tiles of 64 or 128
rows, and a chunk that ends mid-tile wastes the rest of it, every chunk of the step."""


def chunk_tokens(local_vocab: int, softmax_bytes: int) -> int:
    """Tokens per chunk: the most whose softmax over `local_vocab` (V/t) columns, of
    `softmax_bytes` each, fits CHUNK_BYTES, rounded down to a multiple of ROWS_ALIGN
    where that leaves any (a matrix unit's tiles are whole on the GPU), at least one."""
    fitting = CHUNK_BYTES // (local_vocab * softmax_bytes)
    return max(1, fitting - fitting % ROWS_ALIGN if fitting >= ROWS_ALIGN else fitting)
