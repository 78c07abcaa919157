"""Llama as shapes: the parameters of its blocks and norms, and its rotary (unlearned)
positions, as the modules of stageserver/model/llama/model.py hold them (tests hold the
two to each other), for the coordinator's memory model and FLOP count without building a
module."""

from __future__ import annotations

from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import Shapes

LEARNED_POSITIONS = False


def norm_parameters(config: ModelShape) -> Shapes:
    """An RMSNorm's parameters (a scale, no bias), as `final_norm` and ln_1/ln_2 hold them."""
    return {"weight": ((config.d_model,), None)}


def block_parameters(config: ModelShape) -> Shapes:
    """Block's parameters without building it, for the coordinator's memory model and
    FLOP count (common/model/shapes.py): q, k, v, gate and up split along their
    outputs (dim 0), proj and down along their inputs (dim 1), the norms replicated.
    Llama-2 7B's (d=4096, 32 heads and key/value heads, ffn_hidden=11008):
    4*4096^2 + 3*11008*4096 + 2*4096 = 202,383,360 parameters."""
    d, hd, f = config.d_model, config.head_dim, config.ffn_hidden
    norm = norm_parameters(config)
    return {
        **{f"ln_1.{n}": shape for n, shape in norm.items()},
        "attn.q.weight": ((config.n_heads * hd, d), 0),
        "attn.k.weight": ((config.n_kv_heads * hd, d), 0),
        "attn.v.weight": ((config.n_kv_heads * hd, d), 0),
        "attn.proj.weight": ((d, config.n_heads * hd), 1),
        **{f"ln_2.{n}": shape for n, shape in norm.items()},
        "mlp.gate.weight": ((f, d), 0), "mlp.up.weight": ((f, d), 0),
        "mlp.down.weight": ((d, f), 1),
    }
