"""A decoder-only transformer of any architecture, cut into the chunks a pipeline rank
holds.

Parameter names are those of the unsplit model (`h.3.attn.proj.weight`) whichever chunk
holds them, and are the same for every architecture where the part is the same (`wte`,
`h.N.ln_1`, `h.N.attn.proj`, `h.N.mlp.down`, `ln_f`, `lm_head`). Every parameter starts
as its full unsharded tensor - from (seed, name), or from given weights - before this
rank's shard is sliced out (stageserver/model/params.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from interleaf.common.model.architectures import architecture
from interleaf.stageserver.model.architectures import architecture_modules
from interleaf.stageserver.model.attention import LayerCache
from interleaf.common.model.config import ModelShape
from interleaf.common.model.params import HEAD, TIED, ParamSpec
from interleaf.stageserver.model.fused_loss import fused_linear_cross_entropy
from interleaf.stageserver.model.param_ops import embedding
from interleaf.stageserver.model.params import init_full, shard
from interleaf.stageserver.model.recompute import BlockRecompute
from interleaf.stageserver.model.weight_grads import at_once
from interleaf.stageserver.model.tensor_parallel import (
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_logits,
)
from interleaf.stageserver.transport import SoloTransport, Transport

InitialValues = Callable[[str, ParamSpec], torch.Tensor]
"""(name, spec) -> the unsharded, unpadded value of that parameter (full_shape)."""


def _check_layout(config: ModelShape, layers: range, tp: Transport) -> None:
    if config.d_model % config.n_heads:
        raise ValueError(
            f"d_model={config.d_model} must be divisible by n_heads={config.n_heads}"
        )
    if config.n_heads % config.n_kv_heads:
        raise ValueError(f"n_kv_heads={config.n_kv_heads} must divide n_heads={config.n_heads}")
    for name in ("n_heads", "n_kv_heads", "ffn_hidden"):
        if getattr(config, name) % tp.size:
            raise ValueError(
                f"{name}={getattr(config, name)} must be divisible by the tensor-parallel size "
                f"{tp.size}: attention heads and MLP columns are split across tp ranks"
            )
    if layers.step != 1 or layers.start < 0 or layers.stop > config.n_layers:
        raise ValueError(
            f"layers={layers} must be a contiguous range within [0, n_layers={config.n_layers})"
        )


class ModelChunk(nn.Module):
    """Global layers `layers` of the model, plus the embedding (first chunk) and/or the
    final norm, head and loss (last chunk), as this tp rank's shard.

    Tied embeddings: a head-only chunk holds its own copy of `wte`, initialised
    identically, whose gradient the pipeline sums with the first chunk's. Untied: the
    last chunk holds `lm_head` and the first `wte`, each once.

    `sequence_parallel` (stageserver/model/sequence_parallel.py): the hidden states a
    chunk takes and gives are this tp rank's slice of the sequence, [b, s/tp, d]; the
    embedding's lookup is reduce-scattered to it, and the head gathers the final norm's
    output back to the whole sequence. The parameters replicated over tp (norms,
    row-parallel biases, wpe) then see only this rank's tokens: their gradients are
    partial sums, which ModelState sums over the tensor group before the optimizer."""

    def __init__(
        self,
        config: ModelShape,
        layers: range,
        has_embedding: bool,
        has_head: bool,
        tp: Transport,
        seed: int,
        initial: InitialValues | None = None,
        sequence_parallel: bool = False,
        recompute: BlockRecompute = BlockRecompute(),
    ):
        super().__init__()
        _check_layout(config, layers, tp)
        if sequence_parallel and config.seq_len % tp.size:
            raise ValueError(f"seq_len={config.seq_len} must be divisible by the tensor-parallel size {tp.size} "
                             f"for sequence parallelism")
        arch, modules = architecture(config.arch), architecture_modules(config.arch)
        self.config = config
        self.has_embedding = has_embedding
        self.has_head = has_head
        self.tp = tp
        self.recompute = recompute  # which blocks keep what for the backward (recompute.py)
        self.compiled_loss = False  # the loss's arithmetic through inductor (compiled.py, fused_loss.py)
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.rows = config.padded_vocab(tp.size)
        if has_embedding or (has_head and config.tie_embeddings):
            self.wte = VocabParallelEmbedding(self.rows, config.d_model, tp, self.sequence_parallel)
        if has_embedding and arch.LEARNED_POSITIONS:
            self.wpe = nn.Embedding(config.seq_len, config.d_model)
        self.h = nn.ModuleDict({str(i): modules.Block(config, tp, self.sequence_parallel) for i in layers})
        if has_head:
            self.ln_f = modules.final_norm(config)
            if not config.tie_embeddings:
                self.lm_head = VocabParallelHead(self.rows, config.d_model, tp)
        self._specs = self._describe_params()
        initial = initial or (lambda name, spec: init_full(name, spec.full_shape, config.n_layers, seed))
        with torch.no_grad():
            for name, param in self.named_parameters():
                param.copy_(shard(initial(name, self._specs[name]), self._specs[name], tp))

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
            padded = None
            if name in (TIED, HEAD):
                padded, shape[0] = shape[0], self.config.vocab_size
            specs[name] = ParamSpec(tuple(shape), dim, param.dim() >= 2,
                                    name == TIED and self.config.tie_embeddings, padded)
        return specs

    def param_specs(self) -> dict[str, ParamSpec]:
        """Every parameter's unsharded description, in named_parameters order."""
        return dict(self._specs)

    def unpadded_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's parameters as checkpoints hold them: padding rows cut off (views)."""
        return {name: (p.detach()[:self._specs[name].full_shape[0]] if self._specs[name].padded_rows else p.detach())
                for name, p in self.named_parameters()}

    def embed(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Hidden states of token ids [b, s] at positions start, start+1, ... (sequence
        parallel: of this rank's slice of them)."""
        x = self.wte(tokens)
        if hasattr(self, "wpe"):
            end = start + tokens.size(1)
            if end > self.config.seq_len:
                raise ValueError(f"position {end - 1} is beyond the {self.config.seq_len} learned "
                                 f"positions (model.seq_len)")
            first = start + self.tp.rank * x.size(1) if self.sequence_parallel else start
            x = x + embedding(torch.arange(first, first + x.size(1), device=tokens.device), self.wpe.weight)
        return x

    def head_weight(self) -> torch.Tensor:
        return self.wte.weight if self.config.tie_embeddings else self.lm_head.weight

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [b, s] (first chunk) or hidden states [b, s, d] in; hidden states out,
        or on the last chunk the mean cross-entropy over all b*s tokens of `targets`."""
        if self.has_embedding:
            x = self.embed(x)
        for index, block in self.h.items():
            x = self.recompute(int(index), block, x)
        if not self.has_head:
            return x
        if targets is None:
            raise ValueError("the chunk holding the head needs targets to compute the loss")
        # The head's gradient is made in its forward (fused_loss.py), and ln_f's W would
        # keep its input and output gradient: both computed in I (weight_grads.at_once).
        with at_once():
            return fused_linear_cross_entropy(self.ln_f(x), self.head_weight(), targets, self.tp,
                                              self.config.vocab_size, self.sequence_parallel,
                                              compiled=self.compiled_loss)


def next_token_logits(model: ModelChunk, tokens: torch.Tensor,
                      cache: list[LayerCache] | None = None) -> torch.Tensor:
    """[b, vocab] logits of the token after each row of `tokens` [b, s], for a whole
    model in one process (generation and evaluation). With a `cache` (one LayerCache
    per layer), `tokens` are the positions after those already cached, and their keys
    and values are added to it."""
    if not (model.has_embedding and model.has_head) or model.tp.size != 1:
        raise ValueError("next_token_logits needs the whole model in one process")
    return all_logits(model, tokens, cache)[:, -1]


def all_logits(model: ModelChunk, tokens: torch.Tensor, cache: list[LayerCache] | None = None) -> torch.Tensor:
    """[b, s, vocab] logits at every position of `tokens` [b, s] (whole model, one
    process), padding rows cut off."""
    start = cache[0].length if cache else 0
    x = model.embed(tokens, start)
    for i, block in enumerate(model.h.values()):
        x = block(x, cache[i] if cache else None)
    return vocab_parallel_logits(model.ln_f(x), model.head_weight(), model.tp)[..., :model.config.vocab_size]


def full_model(config: ModelShape, seed: int, initial: InitialValues | None = None) -> ModelChunk:
    """The whole model in one process: the single-process reference every layout matches."""
    return ModelChunk(config, range(config.n_layers), True, True, SoloTransport(), seed, initial)
