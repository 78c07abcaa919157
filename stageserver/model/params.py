"""Every parameter's initial value from (seed, name) alone, and a rank's shard of it.
What a parameter is (its shape and split, ParamSpec) is common/model/params.py.

Every parameter is initialised as its full unsharded tensor before a rank's shard is
sliced out, so any layout - pipeline chunks, tensor-parallel shards, padded
vocabularies - starts from weights bit-identical to the single model, which is what the
equivalence contract (DESIGN.md) rests on.
"""

from __future__ import annotations

import math
import zlib

import torch

from interleaf.common.model.config import INIT_STD
from interleaf.common.model.params import ParamSpec
from interleaf.stageserver.model.tensor_parallel import tp_shard

_RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.down.weight")


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
