"""Llama's blocks and final norm, as the chunk builder (stageserver/model/chunk.py)
asks an architecture for them; their parameters as shapes are common/model/llama.py.
Positions enter through rotary embeddings inside
attention, so there is no position table and seq_len bounds only the training length."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from interleaf.common.model.config import ModelShape
from interleaf.stageserver.model.attention import LayerCache, causal_attention
from interleaf.stageserver.model.llama.rope import apply_rotary, rotary_tables
from interleaf.stageserver.model.param_ops import scale
from interleaf.stageserver.model.tensor_parallel import ColumnParallelLinear, RowParallelLinear, column_parallel
from interleaf.stageserver.transport import Transport


class RMSNorm(nn.Module):
    """x / rms(x) · weight (Zhang & Sennrich 2019). Narrow dtypes are normalised in
    float32 and cast back before the scale, as transformers' LlamaRMSNorm does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        work = x.float() if torch.finfo(x.dtype).bits < 32 else x
        normed = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + self.eps)
        return scale(self.weight, normed.to(x.dtype))


class Attention(nn.Module):
    """Grouped-query attention with rotary positions. Query heads and key/value heads
    are both split across tp ranks (q, k and v column-parallel, each head-major), so
    rank t's query heads read exactly its own key/value heads. Sequence parallel: x is
    this rank's slice of the sequence, gathered once for q, k and v; the rotary angles
    are then those of the whole sequence's positions."""

    def __init__(self, config: ModelShape, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        d, hd = config.d_model, config.head_dim
        self.local_heads = config.n_heads // tp.size
        self.local_kv_heads = config.n_kv_heads // tp.size
        self.head_dim, self.config = hd, config
        split = dict(bias=False, sequence_parallel=sequence_parallel)
        self.q = ColumnParallelLinear(d, config.n_heads * hd, tp, **split)
        self.k = ColumnParallelLinear(d, config.n_kv_heads * hd, tp, **split)
        self.v = ColumnParallelLinear(d, config.n_kv_heads * hd, tp, **split)
        self.proj = RowParallelLinear(config.n_heads * hd, d, tp, **split)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        q, k, v = column_parallel(x, self.q, self.k, self.v)
        b, s = q.shape[:2]  # the whole sequence, also where x holds a slice of it
        q = q.view(b, s, self.local_heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.local_kv_heads, self.head_dim).transpose(1, 2)
        start = 0 if cache is None else cache.length
        positions = torch.arange(start, start + s, device=x.device)
        cos, sin = rotary_tables(positions, self.config, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.extend(k, v)
        y = causal_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    """SwiGLU (Shazeer 2020): down(silu(gate(x)) · up(x)); gate and up column-parallel,
    elementwise per shard, down row-parallel (sequence parallel: gate and up share one
    gather)."""

    def __init__(self, config: ModelShape, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        split = dict(bias=False, sequence_parallel=sequence_parallel)
        self.gate = ColumnParallelLinear(config.d_model, config.ffn_hidden, tp, **split)
        self.up = ColumnParallelLinear(config.d_model, config.ffn_hidden, tp, **split)
        self.down = RowParallelLinear(config.ffn_hidden, config.d_model, tp, **split)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = column_parallel(x, self.gate, self.up)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm block: x + attn(ln_1(x)), then + mlp(ln_2(.)), with RMSNorms. Sequence
    parallel: x, the norms and the residual adds are this rank's slice of the sequence."""

    def __init__(self, config: ModelShape, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        self.ln_1 = RMSNorm(config.d_model, config.norm_eps)
        self.attn = Attention(config, tp, sequence_parallel)
        self.ln_2 = RMSNorm(config.d_model, config.norm_eps)
        self.mlp = MLP(config, tp, sequence_parallel)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


def final_norm(config: ModelShape) -> nn.Module:
    return RMSNorm(config.d_model, config.norm_eps)
