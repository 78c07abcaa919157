"""Megatron-LM's sequence parallelism (Korthikanti et al. 2022, section 4.2.2), over a
Transport: between tensor-parallel regions the residual stream is split along the
sequence, [b, s/t, d] on tensor rank r holding positions [r*s/t, (r+1)*s/t).

The paper's two conjugate operators replace tensor_parallel.py's f and g:
  g  = gather (into a column-parallel region): all-gather along the sequence forward,
       reduce-scatter backward (each rank's input gradient is a partial sum over the
       ranks' column slices, and it needs only its own positions of the sum);
  g' = reduce-scatter (out of a row-parallel region): reduce-scatter forward (the
       partial products summed, each rank keeping its positions), all-gather backward.
An all-reduce is a reduce-scatter followed by an all-gather, so a block moves as many
bytes as with plain tensor parallelism, and every norm and residual add between the
regions works on 1/t of the tokens and keeps 1/t of the activations.

The column-parallel linears keep only their local input for the backward and gather it
again there (as Megatron's LinearWithGradAccumulationAndAsyncCommunication does): the
gathered [b, s, d] input is the one activation that would otherwise not shrink with t.
Linears that read one input (llama's q, k and v; gate and up) share one gather each way.

The collectives concatenate along dim 0, and the sequence is dim 1 of [b, s, d], so the
slices are moved sequence-major ([s, b, d], transposed around each collective).

Worked example, t=2, b=1, s=4: rank 0 holds tokens 0-1, rank 1 tokens 2-3 of the
residual stream; `gather` gives both ranks tokens 0-3 for their column slices of q, k, v;
the attention's output projection gives each rank a [1, 4, d] partial sum, and
`reduce_scatter` leaves rank 0 the sum at tokens 0-1 and rank 1 at tokens 2-3.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F

from interleaf.stageserver.model.collective_replay import replayable
from interleaf.stageserver.model.param_ops import linear_grads, weight_grad
from interleaf.stageserver.model.weight_grads import param_grads, remember
from interleaf.stageserver.transport import Transport


def gather(x: torch.Tensor, tp: Transport) -> torch.Tensor:
    """[b, s/t, ...] on every rank -> [b, s, ...], the ranks' slices in rank order (a
    sequence-major tensor seen batch-major: a view, not contiguous)."""
    local = x.transpose(0, 1).contiguous()
    whole = local.new_empty((tp.size * local.size(0), *local.shape[1:]))
    tp.all_gather(whole, local)
    return whole.transpose(0, 1)


def scatter_sum(y: torch.Tensor, tp: Transport) -> torch.Tensor:
    """[b, s, ...] partial sums on every rank -> this rank's [b, s/t, ...] of their sum,
    contiguous (it is the residual stream, and what a pipeline send moves)."""
    seq_major = y.transpose(0, 1).contiguous()
    if seq_major.size(0) % tp.size:
        raise ValueError(f"a sequence of {seq_major.size(0)} tokens does not split over {tp.size} tensor ranks")
    mine = seq_major.new_empty((seq_major.size(0) // tp.size, *seq_major.shape[1:]))
    tp.reduce_scatter(mine, seq_major)
    return mine.transpose(0, 1).contiguous()


class _LinearReduceScatter(torch.autograd.Function):
    """g' fused with the row-parallel matmul before it: the partial product [b, s, d] is a
    temporary of the forward, never kept (a selective-recompute rerun replays the
    reduce-scattered [b, s/t, d] and computes neither). Split-aware (weight_grads.py):
    a deferred weight gradient keeps the output gradient the backward gathered, so W
    communicates nothing."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, tp: Transport) -> torch.Tensor:
        remember(ctx, weight)
        ctx.tp = tp
        ctx.save_for_backward(x, weight)
        return replayable(lambda: scatter_sum(F.linear(x, weight), tp))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        whole = gather(grad, ctx.tp)
        return whole.matmul(weight), *param_grads(ctx, weight_grad, whole, x), None


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, tp: Transport) -> torch.Tensor:
    """A row-parallel matmul and g': this rank's tokens of the summed product."""
    return _LinearReduceScatter.apply(x, weight, tp)


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, tp: Transport) -> torch.Tensor:
        ctx.tp = tp
        # Only the embedding uses it, outside every selectively recomputed block: the
        # row-parallel linears reduce-scatter inside _LinearReduceScatter, recorded with their product.
        return scatter_sum(y, tp)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return gather(grad, ctx.tp), None


def reduce_scatter(y: torch.Tensor, tp: Transport) -> torch.Tensor:
    """g': partial sums over the whole sequence in, this rank's slice of their sum out."""
    return _ReduceScatter.apply(y, tp)


def _gathered_param_grads(has_bias: list[bool], whole: torch.Tensor, *grads: torch.Tensor) -> tuple:
    """Each linear's weight and bias gradient, flat as _GatheredLinears' parameters."""
    return tuple(g for grad, bias in zip(grads, has_bias, strict=True) for g in linear_grads(bias, grad, whole))


class _GatheredLinears(torch.autograd.Function):
    """F.linear(gather(x), w_i, b_i) for each (w_i, b_i), keeping only x (local) for the
    backward, where x is gathered again. Parameters are flat (w0, b0, w1, b1, ...),
    None for a missing bias. Split-aware (weight_grads.py): deferred weight gradients
    keep the gathered input until W, which then needs no gather of its own (t times
    the local input's bytes, for as long as W waits)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: Transport, *params):
        weights, biases = params[0::2], params[1::2]
        remember(ctx, *params)
        ctx.tp, ctx.has_bias = tp, [b is not None for b in biases]
        ctx.save_for_backward(x, *weights)

        def gathered_products() -> tuple[torch.Tensor, ...]:  # the gathered input: a temporary
            whole = gather(x, tp)
            return tuple(F.linear(whole, w, b) for w, b in zip(weights, biases))
        return replayable(gathered_products)  # a selective-recompute rerun reuses the products

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        whole = gather(x, ctx.tp)
        grad_whole = None
        for grad, w in zip(grads, weights):
            part = grad.matmul(w)
            grad_whole = part if grad_whole is None else grad_whole + part
        return (scatter_sum(grad_whole, ctx.tp), None,
                *param_grads(ctx, partial(_gathered_param_grads, ctx.has_bias), whole, *grads))


def gathered_linears(x: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor | None]],
                     tp: Transport) -> tuple[torch.Tensor, ...]:
    """g then the column-parallel matmuls: x [b, s/t, d] (this rank's tokens) in, one
    [b, s, out_i] per (weight, bias) out, every token of this rank's output columns."""
    return _GatheredLinears.apply(x, tp, *[t for pair in params for t in pair])
