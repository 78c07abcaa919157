"""Rotary position embeddings (Su et al. 2021), in Hugging Face's half-split layout:
feature i of a head pairs with feature i + head_dim/2 (`rotate_half`), so Llama weights
load from and export to `transformers` without permuting q and k."""

from __future__ import annotations

import math

import torch

from interleaf.common.model.config import ModelShape


def inverse_frequencies(config: ModelShape, work: torch.dtype, device: torch.device) -> torch.Tensor:
    """theta^(-2i/head_dim) for i < head_dim/2, each feature pair's turn per position,
    in `work` precision; Llama 3's scaling applied when config.rope_scaling_factor is set."""
    hd = config.head_dim
    inverse = 1.0 / config.rope_theta ** (torch.arange(0, hd, 2, dtype=work, device=device) / hd)
    return _llama3_scaled(inverse, config) if config.rope_scaling_factor else inverse


def _llama3_scaled(inverse: torch.Tensor, config: ModelShape) -> torch.Tensor:
    """Llama 3.1's frequency scaling (Meta's `apply_scaling`; transformers'
    `_compute_llama3_parameters`, whose operations and their order this repeats so the
    float32 tables match bit for bit). A pair whose wavelength 2π/inverse is shorter than
    original/high_freq_factor positions turns as trained; one longer than
    original/low_freq_factor turns `factor` times slower, so the longer context falls
    within the angles seen in training; between them the two are blended linearly in
    original/wavelength. Worked at Llama-3.2-1B's (theta 500000, head_dim 64, factor 32,
    low 1, high 4, original 8192) its 32 pairs have wavelengths 6 to 2.1M positions: the
    15 up to 1,956 (below 8192/4) stay, the 14 from 10,089 (above 8192/1) are divided by
    32, and the 3 between (2,948, 4,443, 6,695) are blended."""
    factor, low, high = config.rope_scaling_factor, config.rope_low_freq_factor, config.rope_high_freq_factor
    original = config.rope_original_positions
    wavelength = 2 * math.pi / inverse
    scaled = torch.where(wavelength > original / low, inverse / factor, inverse)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelength < original / high) & ~(wavelength > original / low)
    return torch.where(between, blended, scaled)


def rotary_tables(positions: torch.Tensor, config: ModelShape,
                  dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each [s, head_dim], for integer `positions` [s]. Computed in float32
    at least (float64 for a float64 model), as transformers does, then cast."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    angles = positions.to(work)[:, None] * inverse_frequencies(config, work, positions.device)[None, :]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat([-second, first], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, heads, s, hd] turned by each position's angles."""
    return x * cos + _rotate_half(x) * sin
