"""GPT-2 as shapes: the parameters of its blocks and norms, and its learned positions, as
the modules of stageserver/model/gpt2/model.py hold them (tests hold the two to each
other), for the coordinator's memory model and FLOP count without building a module."""

from __future__ import annotations

from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import Shapes

LEARNED_POSITIONS = True
"""The first chunk adds a learned position embedding `wpe` to the token embedding."""


def norm_parameters(config: ModelShape) -> Shapes:
    """A LayerNorm's parameters, as `final_norm` and the blocks' ln_1/ln_2 hold them."""
    return {"weight": ((config.d_model,), None), "bias": ((config.d_model,), None)}


def block_parameters(config: ModelShape) -> Shapes:
    """Block's parameters without building it, for the coordinator's memory model and
    FLOP count (common/model/shapes.py): column-parallel weights and biases split
    along their outputs (dim 0), row-parallel weights along their inputs (dim 1), their
    biases and the norms replicated. With d=64 and ffn_hidden=256: 4*64^2 + 2*256*64
    (matrices) + 9*64 + 256 (biases and norms) = 49,984 parameters."""
    d, f = config.d_model, config.ffn_hidden
    norm = norm_parameters(config)
    return {
        **{f"ln_1.{n}": shape for n, shape in norm.items()},
        "attn.qkv.weight": ((3 * d, d), 0), "attn.qkv.bias": ((3 * d,), 0),
        "attn.proj.weight": ((d, d), 1), "attn.proj.bias": ((d,), None),
        **{f"ln_2.{n}": shape for n, shape in norm.items()},
        "mlp.up.weight": ((f, d), 0), "mlp.up.bias": ((f,), 0),
        "mlp.down.weight": ((d, f), 1), "mlp.down.bias": ((d,), None),
    }
