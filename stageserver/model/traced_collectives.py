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

Megatron's operators f and g (tensor_parallel.py), as traced:
  copy_to_tp      f: the identity (a view) forward, `all_reduce` of the gradient backward
  all_reduce      g: a sum over the group forward, the identity backward
Sequence parallelism's are not traced: a traced gather's output would be what the
column-parallel products keep for their backward, the whole sequence's [b, s, d] where
its eager Function keeps this rank's [b, s/t, d] and gathers it again (t times less,
twice a block), so those blocks keep their eager Functions and their graph breaks.

Worked example, a gpt2 block at tp=2 compiled under selective recompute: its graph holds
copy_to_tp before qkv and before fc, and all_reduce after proj and after fc2; the
forward calls all_reduce twice, the backward twice (f's gradients), and its rerun of
the norms and GELU reads the kept output of the first all_reduce and of the products
(the second's goes into the residual sum alone, which no gradient reads).
"""

from __future__ import annotations

import weakref

import torch

from interleaf.stageserver.transport import Transport

_groups: weakref.WeakValueDictionary[int, Transport] = weakref.WeakValueDictionary()
"""Each registered group by its id, for as long as its job holds it."""


def register(tp: Transport) -> int:
    """The group's id for the traced operators (set as `tp.trace_id`, once): the smallest
    no living group holds. A server's next job then gets its predecessor's id, so its
    blocks' graphs, which bake the id in (and guard on it), are reused rather than
    compiled again for every job."""
    if getattr(tp, "trace_id", None) is None:
        tp.trace_id = next(i for i in range(1, len(_groups) + 2) if i not in _groups)  # type: ignore[attr-defined]
        _groups[tp.trace_id] = tp  # type: ignore[attr-defined]
    return tp.trace_id  # type: ignore[attr-defined]


def traced(tp: Transport) -> bool:
    """Whether a block's collective over `tp` is to be one of these operators: inside a
    graph torch.compile traces, for a registered group of more than one rank (callers
    leave sequence parallelism's out)."""
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


COLLECTIVE_OPS = frozenset({torch.ops.interleaf.all_reduce.default})
"""The operators whose outputs selective recompute keeps (recompute.SAVED_OPS): a rerun
never communicates."""
