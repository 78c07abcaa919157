"""Causal attention shared by every architecture, and the key/value cache that lets
generation feed one token at a time.

Training attends a whole sequence to itself (queries and keys of equal length: the
plain causal mask). Generation with a cache attends new queries to every cached key
and to the new keys before them: the causal mask aligned to the bottom right, which
for one new token is no mask at all.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class LayerCache:
    """One layer's keys and values of the positions seen so far, [b, kv_heads, t, hd]."""

    def __init__(self):
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.k is None else self.k.size(2)

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new positions; returns every position's keys and values."""
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(q kᵀ/√hd + causal mask) v for q [b, h, s, hd] and k, v [b, kv_heads, t, hd]
    with t >= s (the last s of the t positions are the queries'). Grouped-query
    attention: query head i reads key/value head i // (h / kv_heads), as Hugging Face's
    `repeat_kv` lays them out, which keeps tensor-parallel shards of both aligned."""
    groups = q.size(1) // k.size(1)
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    s, t = q.size(2), k.size(2)
    if s == t:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    if s == 1:  # the newest position sees every cached one
        return F.scaled_dot_product_attention(q, k, v)
    # Query j sits at position t - s + j and sees keys up to it.
    allowed = torch.ones(s, t, dtype=torch.bool, device=q.device).tril(diagonal=t - s)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
