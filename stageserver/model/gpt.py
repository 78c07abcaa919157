"""A GPT-2 style decoder, cut into the chunks a pipeline rank holds.

Parameter names are those of the unsplit model (`h.3.attn.qkv.weight`) whichever chunk
holds them, and every parameter is initialised as its full unsharded tensor from
(seed, name) alone before this rank's shard is sliced out. So any layout - pipeline
chunks, tensor-parallel shards - starts from weights bit-identical to the single model,
which is what the equivalence contract (DESIGN.md) rests on.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from interleaf.stageserver.model.config import INIT_STD, GPTConfig
from interleaf.stageserver.model.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    copy_to_tp,
    tp_shard,
    vocab_parallel_cross_entropy,
)
from interleaf.stageserver.transport import SoloTransport, Transport

TIED = "wte.weight"
"""The input embedding doubles as the output head (GPT-2's weight tying)."""

_RESIDUAL_OUTPUTS = ("attn.proj.weight", "mlp.down.weight")


@dataclass(frozen=True)
class ParamSpec:
    full_shape: tuple[int, ...]
    """Shape of the unsharded tensor."""
    tp_dim: int | None
    """Dimension the full tensor is split along across tp ranks (rank t holds
    full.chunk(tp, dim=tp_dim)[t]); None when every rank holds all of it."""
    weight_decay: bool
    """True for matrices and embeddings; biases and LayerNorm parameters are not decayed."""
    tied: bool
    """True for the embedding shared with the output head (a copy on the first and last
    pipeline stage whose gradients the pipeline sums)."""


def param_seed(seed: int, name: str) -> int:
    """The generator seed of one parameter: independent of layout, chunk and rank."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & ((1 << 63) - 1)


def init_full(name: str, shape: tuple[int, ...], n_layers: int, seed: int) -> torch.Tensor:
    """The unsharded initial value of parameter `name` (nanoGPT's scheme): N(0, 0.02)
    matrices and embeddings, residual output projections scaled by 1/sqrt(2*n_layers)
    (GPT-2 paper, section 2.3), zero biases, LayerNorm scale one."""
    module, leaf = name.rsplit(".", 1)
    if module.rsplit(".", 1)[-1].startswith("ln_"):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if leaf == "bias":
        return torch.zeros(shape)
    std = INIT_STD / math.sqrt(2 * n_layers) if name.endswith(_RESIDUAL_OUTPUTS) else INIT_STD
    generator = torch.Generator().manual_seed(param_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


class Attention(nn.Module):
    """Causal self-attention with the heads split across tp ranks (n_heads/tp each).

    The unsharded qkv weight [3d, d] is head-major - rows [q_h, k_h, v_h] for head h, each
    head_dim long - so a rank's heads are one contiguous slice of it."""

    def __init__(self, config: GPTConfig, tp: Transport):
        super().__init__()
        d = config.d_model
        self.local_heads = config.n_heads // tp.size
        self.head_dim = config.head_dim
        self.qkv = ColumnParallelLinear(d, 3 * d, tp)
        self.proj = RowParallelLinear(d, d, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, self.local_heads, 3, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # each [b, heads, s, hd]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, self.local_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig, tp: Transport):
        super().__init__()
        self.up = ColumnParallelLinear(config.d_model, 4 * config.d_model, tp)
        self.down = RowParallelLinear(4 * config.d_model, config.d_model, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2's tanh approximation of GELU; elementwise, so it applies per shard.
        return self.down(F.gelu(self.up(x), approximate="tanh"))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then + mlp(ln_2(.))."""

    def __init__(self, config: GPTConfig, tp: Transport):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model)
        self.attn = Attention(config, tp)
        self.ln_2 = nn.LayerNorm(config.d_model)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


def _check_layout(config: GPTConfig, layers: range, tp: Transport) -> None:
    if config.d_model % config.n_heads:
        raise ValueError(
            f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}"
        )
    if config.n_heads % tp.size:
        raise ValueError(
            f"n_heads={config.n_heads} must be divisible by the tensor-parallel size "
            f"{tp.size}: attention heads are split across tp ranks"
        )
    if layers.step != 1 or layers.start < 0 or layers.stop > config.n_layers:
        raise ValueError(
            f"layers={layers} must be a contiguous range within [0, n_layers={config.n_layers})"
        )


class GPTChunk(nn.Module):
    """Global layers `layers` of the model, plus the embedding (first chunk) and/or the
    final LayerNorm, tied head and loss (last chunk), as this tp rank's shard."""

    def __init__(
        self,
        config: GPTConfig,
        layers: range,
        has_embedding: bool,
        has_head: bool,
        tp: Transport,
        seed: int,
    ):
        super().__init__()
        _check_layout(config, layers, tp)
        self.config = config
        self.has_embedding = has_embedding
        self.has_head = has_head
        self.tp = tp
        if has_embedding or has_head:
            # A head-only chunk holds its own copy of the tied embedding, initialised
            # identically from the same name; one parameter when it has both ends.
            self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model, tp)
        if has_embedding:
            self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.h = nn.ModuleDict({str(i): Block(config, tp) for i in layers})
        if has_head:
            self.ln_f = nn.LayerNorm(config.d_model)
        self._specs = self._describe_params()
        with torch.no_grad():
            for name, param in self.named_parameters():
                full = init_full(name, self._specs[name].full_shape, config.n_layers, seed)
                param.copy_(tp_shard(full, self._specs[name].tp_dim, tp))

    def _describe_params(self) -> dict[str, ParamSpec]:
        tp_dims = {}
        for module_name, module in self.named_modules():
            for leaf, _ in module.named_parameters(recurse=False):
                name = f"{module_name}.{leaf}" if module_name else leaf
                tp_dims[name] = getattr(module, "TP_DIMS", {}).get(leaf)
        specs = {}
        for name, param in self.named_parameters():
            dim = tp_dims[name]
            shape = list(param.shape)
            if dim is not None:
                shape[dim] *= self.tp.size
            specs[name] = ParamSpec(tuple(shape), dim, param.dim() >= 2, name == TIED)
        return specs

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter's unsharded description, in named_parameters order."""
        return dict(self._specs)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] (first chunk) or hidden states [b, s, d] in; hidden states out,
        or on the last chunk the mean cross-entropy over all b*s tokens of `targets`."""
        if self.has_embedding:
            seq = x.size(1)
            if seq > self.config.seq_len:
                raise ValueError(f"sequence of {seq} tokens exceeds seq_len={self.config.seq_len}")
            x = self.wte(x) + self.wpe(torch.arange(seq, device=x.device))
        for block in self.h.values():
            x = block(x)
        if not self.has_head:
            return x
        if targets is None:
            raise ValueError("the chunk holding the head needs targets to compute the loss")
        # copy_to_tp: every rank multiplies the same hidden states by its vocab slice, so
        # their input gradients are partial sums over the vocabulary.
        logits_shard = F.linear(copy_to_tp(self.ln_f(x), self.tp), self.wte.weight)
        return vocab_parallel_cross_entropy(logits_shard, targets, self.tp)


def next_token_logits(model: GPTChunk, tokens: torch.Tensor) -> torch.Tensor:
    """[b, vocab] logits of the token after each row of `tokens` [b, s], for a whole
    model in one process (text generation): the forward, then the tied head on the
    last position only."""
    if not (model.has_embedding and model.has_head) or model.tp.size != 1:
        raise ValueError("next_token_logits needs the whole model in one process")
    seq = tokens.size(1)
    x = model.wte(tokens) + model.wpe(torch.arange(seq, device=tokens.device))
    for block in model.h.values():
        x = block(x)
    return F.linear(model.ln_f(x[:, -1]), model.wte.weight)


def full_model(config: GPTConfig, seed: int) -> GPTChunk:
    """The whole model in one process: the single-process reference every layout matches."""
    return GPTChunk(config, range(config.n_layers), True, True, SoloTransport(), seed)
