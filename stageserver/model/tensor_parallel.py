"""Megatron-LM tensor-parallel layers (Shoeybi et al. 2019, section 3), over a Transport.

Each layer holds only this rank's shard of the unsharded parameter; `TP_DIMS` names the
dimension each parameter is split along (None: replicated), so whoever initialises or
checkpoints the model can slice the full tensor with `tp_shard`. Layers are created
uninitialised: the owner (ModelChunk) fills them from the unsharded initialisation, which
is what keeps every layout bit-identical at step 0.

The two conjugate operators of the paper's figure 3:
  f = copy_to_tp:    identity forward, all-reduce backward (enters a parallel region);
  g = reduce_from_tp: all-reduce forward, identity backward (leaves it).
With a group of one both are the identity, so every layer reduces to the plain op.
Under sequence parallelism (`sequence_parallel=True`, sequence_parallel.py) the layers
take and give the residual stream split along the sequence instead: a column-parallel
layer's input is gathered (by `column_parallel`, once for every layer reading it) and a
row-parallel layer's output reduce-scattered.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from interleaf.stageserver.model import sequence_parallel as sp
from interleaf.stageserver.model import traced_collectives
from interleaf.stageserver.model.collective_replay import replayable
from interleaf.stageserver.model.param_ops import add_bias, embedding, linear, weight_grad
from interleaf.stageserver.model.weight_grads import param_grads, remember
from interleaf.stageserver.transport import Transport


Float8Product = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""What a linear runs instead of its product under train.precision=fp8 (fp8.py, tp=1)."""


def _divide(n: int, tp: Transport, what: str) -> int:
    if n % tp.size:
        raise ValueError(f"{what}={n} must be divisible by the tensor-parallel size {tp.size}")
    return n // tp.size


def tp_shard(full: torch.Tensor, dim: int | None, tp: Transport) -> torch.Tensor:
    """This rank's slice of an unsharded tensor split along `dim` (all of it if None)."""
    return full if dim is None else full.chunk(tp.size, dim=dim)[tp.rank]


def _summed(tensor: torch.Tensor, tp: Transport) -> torch.Tensor:
    # A fresh contiguous buffer: gloo reduces in place, and the tensor we were handed may
    # be saved by autograd for another node's backward.
    out = tensor.clone(memory_format=torch.contiguous_format)
    tp.all_reduce(out)
    return out


class _LinearAllReduce(torch.autograd.Function):
    """A row-parallel matmul and g fused: the partial product is a temporary of the
    forward, never kept (a selective-recompute rerun replays the sum). Split-aware
    (weight_grads.py): the weight's gradient reads x and the (replicated) output
    gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: Transport) -> torch.Tensor:
        remember(ctx, weight)
        ctx.save_for_backward(x, weight)
        return replayable(lambda: _summed(F.linear(x, weight), tp))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        return grad.matmul(weight), *param_grads(ctx, weight_grad, grad, x), None


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Transport) -> torch.Tensor:
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _summed(grad, ctx.tp), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Transport) -> torch.Tensor:
        # Only the vocab-parallel embedding uses it, outside every selectively recomputed
        # block: the row-parallel linears sum inside _LinearAllReduce, recorded with their product.
        return _summed(x, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def copy_to_tp(x: torch.Tensor, tp: Transport) -> torch.Tensor:
    """Megatron's f: each rank's partial input gradient is summed over the group."""
    return x if tp.size == 1 else _CopyToTP.apply(x, tp)


def reduce_from_tp(x: torch.Tensor, tp: Transport) -> torch.Tensor:
    """Megatron's g: partial outputs are summed; the gradient is already replicated."""
    return x if tp.size == 1 else _ReduceFromTP.apply(x, tp)


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by output rows: rank t computes output features
    [t*out/tp, (t+1)*out/tp). The output stays sharded for a RowParallelLinear to consume.
    Sequence parallel: x is this rank's slice of the sequence, y covers all of it."""

    TP_DIMS: ClassVar[dict[str, int | None]] = {"weight": 0, "bias": 0}
    float8: Float8Product | None = None

    def __init__(self, in_features: int, out_features: int, tp: Transport, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        local = _divide(out_features, tp, "ColumnParallelLinear out_features")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.empty(local)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel(x, self)[0]


def column_parallel(x: torch.Tensor, *layers: ColumnParallelLinear) -> tuple[torch.Tensor, ...]:
    """Each layer applied to x, which they all read. Sequence parallel: x gathered once
    for all of them (and its gradient reduce-scattered once); otherwise each layer's own
    copy_to_tp, as before sequence parallelism existed, so those layouts compute the
    same bits. Inside a compiled block the same collectives, as the traced operators
    (traced_collectives.py), in the same number (the planner counts them)."""
    tp = layers[0].tp
    if traced_collectives.traced(tp):  # inside a compiled block: the collectives as graph nodes
        if layers[0].sequence_parallel:
            return traced_collectives.gathered_linears(x, [(layer.weight, layer.bias) for layer in layers], tp)
        return tuple(F.linear(traced_collectives.copy_to_tp(x, tp), layer.weight, layer.bias) for layer in layers)
    if layers[0].sequence_parallel and tp.size > 1:
        return sp.gathered_linears(x, [(layer.weight, layer.bias) for layer in layers], tp)
    return tuple((layer.float8 or linear)(copy_to_tp(x, layer.tp), layer.weight, layer.bias) for layer in layers)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by input columns: rank t holds input features
    [t*in/tp, (t+1)*in/tp), which is exactly the shard a ColumnParallelLinear produced.
    The bias is replicated and added once, after the partial products are summed."""

    TP_DIMS: ClassVar[dict[str, int | None]] = {"weight": 1, "bias": None}
    float8: Float8Product | None = None

    def __init__(self, in_features: int, out_features: int, tp: Transport, bias: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        local = _divide(in_features, tp, "RowParallelLinear in_features")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, local))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Sequence parallel: the sum is reduce-scattered, this rank's tokens out (the
        bias then sees only them: its gradient is a partial sum, see ModelState)."""
        if self.float8:
            y = self.float8(x, self.weight, None)
        elif traced_collectives.traced(self.tp):  # inside a compiled block
            partial = F.linear(x, self.weight)
            y = (traced_collectives.scatter_sum(partial, self.tp) if self.sequence_parallel
                 else traced_collectives.all_reduce(partial, self.tp))
        elif self.tp.size == 1:
            y = linear(x, self.weight)
        elif self.sequence_parallel:
            y = sp.linear_reduce_scatter(x, self.weight, self.tp)
        else:
            y = _LinearAllReduce.apply(x, self.weight, self.tp)
        return y if self.bias is None else add_bias(y, self.bias)


class VocabParallelEmbedding(nn.Module):
    """Rank t holds rows [t*V/tp, (t+1)*V/tp) of the (padded) embedding table of V rows.
    Each rank looks up the ids it owns, contributes zeros for the rest, and the sum over
    ranks is the lookup (sequence parallel: reduce-scattered, this rank's tokens out)."""

    TP_DIMS: ClassVar[dict[str, int | None]] = {"weight": 0}

    def __init__(self, rows: int, dim: int, tp: Transport, sequence_parallel: bool = False):
        super().__init__()
        local = _divide(rows, tp, "VocabParallelEmbedding rows")
        self.tp, self.sequence_parallel = tp, sequence_parallel
        self.start = tp.rank * local
        self.weight = nn.Parameter(torch.empty(local, dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.start) | (ids >= self.start + self.weight.size(0))
        local_ids = (ids - self.start).masked_fill(outside, 0)
        rows = embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel and self.tp.size > 1:
            return sp.reduce_scatter(rows, self.tp)
        return reduce_from_tp(rows, self.tp)


class VocabParallelHead(nn.Module):
    """The output head of a model with untied embeddings: rows split over the vocabulary
    as the embedding's are, so logits stay vocab-parallel for the cross-entropy."""

    TP_DIMS: ClassVar[dict[str, int | None]] = {"weight": 0}

    def __init__(self, rows: int, dim: int, tp: Transport):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(_divide(rows, tp, "VocabParallelHead rows"), dim))


def vocab_parallel_logits(x: torch.Tensor, head_weight: torch.Tensor, tp: Transport,
                          sequence_parallel: bool = False) -> torch.Tensor:
    """This rank's vocabulary slice of the logits. copy_to_tp: every rank multiplies the
    same hidden states by its slice, so their input gradients are partial sums. Sequence
    parallel: x is this rank's tokens, gathered first (the gradient reduce-scattered)."""
    if sequence_parallel and tp.size > 1:
        return sp.gathered_linears(x, [(head_weight, None)], tp)[0]
    return linear(copy_to_tp(x, tp), head_weight)
