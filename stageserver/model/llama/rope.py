"""Rotary position embeddings (Su et al. 2021), in Hugging Face's half-split layout:
feature i of a head pairs with feature i + head_dim/2 (`rotate_half`), so Llama weights
load from and export to `transformers` without permuting q and k."""

from __future__ import annotations

import torch


def rotary_tables(positions: torch.Tensor, head_dim: int, theta: float,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [s, head_dim], for integer `positions` [s]. Computed in float32
    at least (float64 for a float64 model), as transformers does, then cast."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inverse = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=work, device=positions.device) / head_dim)
    angles = positions.to(work)[:, None] * inverse[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, hd] turned by each position's angles."""
    return x * cos + _rotate_half(x) * sin
