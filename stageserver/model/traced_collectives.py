"""The tensor-parallel collectives of a block as operations `torch.compile` traces.

Eager, a block's collectives are autograd Functions that call the Transport
(tensor_parallel.py, sequence_parallel.py): dynamo cannot trace into a call to gloo or
NCCL, so a compiled tensor-parallel block broke into a graph per stretch between its
collectives, and a graph break cannot fall inside a checkpointed region, which kept
selective recompute of compiled blocks to tp = 1. Registered as custom operators
(`torch.library.custom_op`, as torch's own functional collectives are), each collective
is one opaque node of the block's graph, with a shape rule for tracing and its backward
registered beside it, so the block compiles whole, and compiled together with its
selective checkpoint (recompute.SelectiveCheckpointed) the policy sees each collective
as an operation: it keeps their outputs (recompute.SAVED_OPS), and the backward's rerun
neither communicates nor recomputes a matrix product.

The operators take the tensor group as an integer, the id `register` gave its
Transport; a compiled graph bakes it in as a constant. They run the Transport's own
calls, metered as every call is (transport/metered.py). Inside compiled graphs only
(torch.compiler.is_compiling()): eager blocks keep their fused autograd Functions and
their replay tape (collective_replay.py), so eager layouts compute what they did.

Megatron's operators (tensor_parallel.py's f and g, sequence_parallel.py's), as traced:
  copy_to_tp        f: the identity (a view) forward, `all_reduce` of the gradient
                    backward (one per linear reading the input, as eager)
  all_reduce        g: a sum over the group forward, the identity backward
  gathered_linears  all-gather along the sequence and the column-parallel products that
                    read it, as one operator: its backward keeps this rank's tokens and
                    gathers them again, as sequence_parallel.py's Function does (a
                    gather node's output would be kept whole, t times the bytes)
  scatter_sum       g': reduce-scatter along the sequence forward, all-gather backward

Worked example, a gpt2 block at tp=2 compiled under selective recompute: its graph holds
copy_to_tp before qkv and before fc, and all_reduce after proj and after fc2; the
forward calls all_reduce twice, the backward twice (f's gradients), and its rerun of
the norms and GELU reads the kept output of the first all_reduce and of the products
(the second's goes into the residual sum alone, which no gradient reads).
"""

from __future__ import annotations

import gc
import weakref

import torch
import torch.nn.functional as F

from interleaf.stageserver.model import sequence_parallel as sp
from interleaf.stageserver.transport import Transport

_groups: weakref.WeakValueDictionary[int, Transport] = weakref.WeakValueDictionary()
"""Each registered group by its id, for as long as its job holds it."""


def register(tp: Transport) -> int:
    """The group's id for the traced operators (set as `tp.trace_id`, once): the smallest
    no living group holds (a job's groups let go of first: a reference cycle may hold a
    finished job's for a while). A server's next job then gets its predecessor's id, so
    its blocks' graphs, which bake the id in (and guard on it), are reused rather than
    compiled again for every job."""
    if getattr(tp, "trace_id", None) is None:
        if _groups:
            gc.collect()
        tp.trace_id = next(i for i in range(1, len(_groups) + 2) if i not in _groups)  # type: ignore[attr-defined]
        _groups[tp.trace_id] = tp  # type: ignore[attr-defined]
    return tp.trace_id  # type: ignore[attr-defined]


def traced(tp: Transport) -> bool:
    """Whether a block's collective over `tp` is to be one of these operators: inside a
    graph torch.compile traces, for a registered group of more than one rank."""
    return torch.compiler.is_compiling() and tp.size > 1 and getattr(tp, "trace_id", None) is not None


@torch.library.custom_op("interleaf::all_reduce", mutates_args=())
def _all_reduce(x: torch.Tensor, group: int) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # gloo reduces in place
    _groups[group].all_reduce(out)
    return out


@_all_reduce.register_fake
def _(x: torch.Tensor, group: int) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_all_reduce.register_autograd(lambda ctx, grad: (grad, None))


@torch.library.custom_op("interleaf::gather", mutates_args=())
def _gather(x: torch.Tensor, group: int) -> torch.Tensor:
    """All-gather along the sequence (dim 1): [b, s/t, ...] -> [b, s, ...], contiguous."""
    return sp.gather(x, _groups[group]).contiguous()


@_gather.register_fake
def _(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.new_empty((x.size(0), x.size(1) * _groups[group].size, *x.shape[2:]))


@torch.library.custom_op("interleaf::scatter_sum", mutates_args=())
def _scatter_sum(y: torch.Tensor, group: int) -> torch.Tensor:
    """Reduce-scatter along the sequence: [b, s, ...] partial sums -> this rank's
    [b, s/t, ...] of their sum."""
    return sp.scatter_sum(y, _groups[group])


@_scatter_sum.register_fake
def _(y: torch.Tensor, group: int) -> torch.Tensor:
    return y.new_empty((y.size(0), y.size(1) // _groups[group].size, *y.shape[2:]))


def _keep_group(ctx, inputs, output) -> None:
    ctx.group = inputs[-1]


# g' (sequence_parallel.py): reduce-scatter forward, all-gather backward
_scatter_sum.register_autograd(lambda ctx, grad: (_gather(grad, ctx.group), None), setup_context=_keep_group)


@torch.library.custom_op("interleaf::gathered_linears", mutates_args=())
def _gathered_linears(x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor],
                      group: int) -> list[torch.Tensor]:
    """F.linear(gather(x), w_i, b_i) for each w_i (and b_i: every linear has a bias, or
    none has, `biases` empty): sequence_parallel.py's gathered_linears as one operator,
    so that what its backward keeps is this rank's tokens x, gathered again there,
    never the gathered [b, s, d] (a graph of a gather and linears would keep that for
    the weights' gradients)."""
    whole = sp.gather(x, _groups[group])
    return [F.linear(whole, w, biases[i] if biases else None) for i, w in enumerate(weights)]


@_gathered_linears.register_fake
def _(x, weights, biases, group):
    return [x.new_empty((x.size(0), x.size(1) * _groups[group].size, w.size(0))) for w in weights]


def _gathered_setup(ctx, inputs, output) -> None:
    x, weights, biases, group = inputs
    ctx.group, ctx.has_bias = group, bool(biases)
    ctx.save_for_backward(x, *weights)


def _gathered_backward(ctx, grads):
    x, *weights = ctx.saved_tensors
    whole = _gather(x, ctx.group)
    grad_whole = sum(grad.matmul(w) for grad, w in zip(grads, weights, strict=True))
    flat = whole.reshape(-1, whole.size(-1))
    weight_grads = [grad.reshape(-1, grad.size(-1)).t().matmul(flat) for grad in grads]
    bias_grads = [grad.reshape(-1, grad.size(-1)).sum(0) for grad in grads] if ctx.has_bias else []
    return _scatter_sum(grad_whole, ctx.group), weight_grads, bias_grads, None


_gathered_linears.register_autograd(_gathered_backward, setup_context=_gathered_setup)


class _CopyToTP(torch.autograd.Function):
    """f: a view forward (no copy), the gradient summed over the group backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: int) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_reduce(grad, ctx.group), None


def copy_to_tp(x: torch.Tensor, tp: Transport) -> torch.Tensor:
    return _CopyToTP.apply(x, tp.trace_id)  # type: ignore[attr-defined]


def all_reduce(x: torch.Tensor, tp: Transport) -> torch.Tensor:
    return _all_reduce(x, tp.trace_id)  # type: ignore[attr-defined]


def scatter_sum(y: torch.Tensor, tp: Transport) -> torch.Tensor:
    return _scatter_sum(y, tp.trace_id)  # type: ignore[attr-defined]


def gathered_linears(x: torch.Tensor, params: list[tuple[torch.Tensor, torch.Tensor | None]],
                     tp: Transport) -> tuple[torch.Tensor, ...]:
    biases = [b for _, b in params if b is not None]
    if biases and len(biases) != len(params):
        raise ValueError("gathered linears take a bias each, or none")
    return tuple(_gathered_linears(x, [w for w, _ in params], biases, tp.trace_id))  # type: ignore[attr-defined]


COLLECTIVE_OPS = frozenset({torch.ops.interleaf.all_reduce.default, torch.ops.interleaf.scatter_sum.default,
                            torch.ops.interleaf.gathered_linears.default})
"""The operators whose outputs selective recompute keeps (recompute.SAVED_OPS): a rerun
never communicates."""
