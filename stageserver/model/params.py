"""What every parameter is, independent of layout: its unsharded shape, how tensor
ranks split it, and its initial value from (seed, name) alone.

Every parameter is initialised as its full unsharded tensor before a rank's shard is
sliced out, so any layout - pipeline chunks, tensor-parallel shards, padded
vocabularies - starts from weights bit-identical to the single model, which is what the
equivalence contract (DESIGN.md) rests on.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch

from interleaf.stageserver.model.config import INIT_STD
from interleaf.stageserver.model.tensor_parallel import tp_shard

TIED = "wte.weight"
"""The input embedding, which doubles as the output head when the model ties them."""
HEAD = "lm_head.weight"
"""The output head of a model with untied embeddings."""

_RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.down.weight")

Shapes = dict[str, tuple[tuple[int, ...], int | None]]
"""Parameters by name: (unsharded shape, the dimension tp ranks split it along or None),
as an architecture declares its block and norm without building them."""


@dataclass(frozen=True)
class ParamSpec:
    full_shape: tuple[int, ...]
    """Shape of the unsharded tensor: the true vocabulary for the embedding and head."""
    tp_dim: int | None
    """Dimension the (padded) full tensor is split along across tp ranks (rank t holds
    full.chunk(tp, dim=tp_dim)[t]); None when every rank holds all of it."""
    weight_decay: bool
    """True for matrices and embeddings; biases and norm parameters are not decayed."""
    tied: bool
    """True for the embedding shared with the output head (a copy on the first and last
    pipeline stage whose gradients the pipeline sums)."""
    padded_rows: int | None = None
    """The embedding and head: rows of the padded table (dim 0) that tp ranks split;
    rows from full_shape[0] on are zeros that no token looks up and no logit scores."""


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: independent of layout, chunk and rank."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


def init_full(name: str, shape: tuple[int, ...], n_layers: int, seed: int) -> torch.Tensor:
    """The unsharded initial value of parameter `name` (nanoGPT's scheme, for every
    architecture): N(0, 0.02) matrices and embeddings, residual output projections
    scaled by 1/sqrt(2*n_layers) (GPT-2 paper, section 2.3), zero biases, norm scale one
    (every norm module is named `ln_*`)."""
    module, leaf = name.rsplit(".", 1)
    if module.rsplit(".", 1)[-1].startswith("ln_"):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(_RESIDUAL_OUTPUTS) else INIT_STD
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def shard(full: torch.Tensor, spec: ParamSpec, tp) -> torch.Tensor:
    """This rank's slice of an unsharded (unpadded) tensor: padded with zero rows to the
    table's size first where the spec says so."""
    if spec.padded_rows is not None and spec.padded_rows > full.size(0):
        pad = full.new_zeros((spec.padded_rows - full.size(0), *full.shape[1:]))
        full = torch.cat([full, pad])
    return tp_shard(full, spec.tp_dim, tp)


def true_rows(spec: ParamSpec, tp_rank: int, tp_size: int) -> int | None:
    """Of this rank's local rows of a padded table, how many hold real tokens (the rest
    are padding); None for a parameter that is not padded."""
    if spec.padded_rows is None:
        return None
    local = spec.padded_rows // tp_size
    return max(0, min(local, spec.full_shape[0] - tp_rank * local))
