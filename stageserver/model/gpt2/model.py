"""GPT-2's blocks and final norm as modules, as the chunk builder
(stageserver/model/chunk.py) asks an architecture for them; their parameters as shapes,
and the learned positions, are common/model/gpt2.py."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.model.attention import LayerCache, causal_attention
from interleaf.stageserver.model.param_ops import LayerNorm
from interleaf.stageserver.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from interleaf.stageserver.transport import Transport


class Attention(nn.Module):
    """Causal self-attention with the heads split across tp ranks (n_heads/tp each).

    The unsharded qkv weight [3d, d] is head-major - rows [q_h, k_h, v_h] for head h, each
    head_dim long - so a rank's heads are one contiguous slice of it. Sequence parallel:
    x is this rank's slice of the sequence, the heads attend over all of it."""

    def __init__(self, config: ModelShape, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        d = config.d_model
        self.local_heads = config.n_heads // tp.size
        self.head_dim = config.head_dim
        self.qkv = ColumnParallelLinear(d, 3 * d, tp, sequence_parallel=sequence_parallel)
        self.proj = RowParallelLinear(d, d, tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        qkv = self.qkv(x)
        b, s = qkv.shape[:2]  # the whole sequence, also where x holds a slice of it
        qkv = qkv.view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, heads, s, hd]
        if cache is not None:
            k, v = cache.extend(k, v)
        y = causal_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelShape, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        self.up = ColumnParallelLinear(config.d_model, config.ffn_hidden, tp, sequence_parallel=sequence_parallel)
        self.down = RowParallelLinear(config.ffn_hidden, config.d_model, tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's tanh approximation of GELU; elementwise, so it applies per shard.
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.)). Sequence
    parallel: x, the norms and the residual adds are this rank's slice of the sequence."""

    def __init__(self, config: ModelShape, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        self.ln_1 = LayerNorm(config.d_model, eps=config.norm_eps)
        self.attn = Attention(config, tp, sequence_parallel)
        self.ln_2 = LayerNorm(config.d_model, eps=config.norm_eps)
        self.mlp = MLP(config, tp, sequence_parallel)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


def final_norm(config: ModelShape) -> nn.Module:
    return LayerNorm(config.d_model, eps=config.norm_eps)
