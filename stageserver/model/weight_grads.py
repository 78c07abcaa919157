"""The backward split in two (Qi et al. 2024, "Zero Bubble Pipeline Parallelism",
section 2): I, the input gradient, which the previous stage waits for, and W, the
parameter gradients, which only the optimizer step waits for, so a schedule may run it
later, in a bubble.

The split is made once, in the operations that read parameters (param_ops.py's linear,
bias, embedding and norms; tensor_parallel.py's and sequence_parallel.py's fused
linears), not by walking the graph twice: each is an autograd Function whose backward
computes its input gradient as always and hands its parameter gradients to
`param_grads`. That returns them to autograd at once (B, the reference, any backward
outside a step), unless the forward ran under a `WeightGrads` (the executor's, one per
chunk and microbatch) that is now `deferring` (I): then it queues them, as a function
and the tensors it reads, and autograd gets None for the parameters (their .grad is
left untouched). W is `WeightGrads.run`: each queued function computed and added into
its parameter's .grad, as autograd's AccumulateGrad would have.

What W reads: only what the backward handed it - each operation's saved input (the
rerun's, under recompute: the closure is filled in the backward, after the rerun) and
output gradient, and what I already gathered over the tensor group (a sequence-parallel
linear's gathered input or gradient) - never a parameter's values, and no collective.
So a ZeRO-3 chunk may be released between its I and its W; only a parameter's shape,
dtype and .grad are used. What it holds from I to W (`tensors`) stays on the memory
ledger's activation account until W.

Each operation's forward records the `WeightGrads` it runs under (the contextvar that
`recording` sets) in its autograd context, rather than its backward looking for one:
on a GPU autograd runs the backward on a thread of its own, which sees none of the
caller's contextvars, while the context travels with the graph. (A block that torch's
checkpoint reruns inside the backward runs its first forward's nodes, and with them
their WeightGrads, on the rerun's tensors: the rerun's own nodes are discarded.)

Worked example, a gpt2 block at tp=1, batch b, sequence s, width d: its I queues eight
functions - the two LayerNorms' (weight and bias each), qkv's and up's (weight and
bias), proj's and down's (weight), and the biases added after proj and down - which
hold each one's input and output gradient (up's: ln_2's output [b, s, d] and the
gradient of its output [b, s, 4d]; storages two of them share are one), and the
LayerNorms' mean and rstd. W computes up.weight's gradient as grad^T @ input, [4d, d],
and adds it into up.weight.grad, a view of the bucket's flat gradient buffer.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import torch

Grads = tuple[torch.Tensor | None, ...]

_recording: contextvars.ContextVar[WeightGrads | None] = contextvars.ContextVar("weight_grads", default=None)


class WeightGrads:
    """The parameter-gradient work of one forward (a chunk on a microbatch): nothing
    unless its backward ran `deferring`, then what that backward queued, until `run`."""

    def __init__(self):
        self.deferring = False
        self._queued: list[tuple[Sequence[torch.Tensor | None], Callable[..., Grads], tuple[torch.Tensor, ...]]] = []

    @contextlib.contextmanager
    def recording(self) -> Iterator[WeightGrads]:
        """Around a forward (or a recompute's rerun) whose parameter gradients may be
        deferred: its split-aware operations remember this object."""
        token = _recording.set(self)
        try:
            yield self
        finally:
            _recording.reset(token)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[WeightGrads]:
        """Around the backward that is I: parameter gradients are queued, not computed."""
        self.deferring = True
        try:
            yield self
        finally:
            self.deferring = False

    def queue(self, params: Sequence[torch.Tensor | None], compute: Callable[..., Grads],
              tensors: tuple[torch.Tensor, ...]) -> None:
        # Detached: the queue must not hold the graph (a saved input's grad_fn, whose
        # context holds this object, would be a cycle no garbage collector breaks).
        self._queued.append((params, compute, tuple(t.detach() for t in tensors)))

    def tensors(self) -> list[torch.Tensor]:
        """What the queue holds until W (for the activation meter: storages repeat)."""
        return [t for _, _, tensors in self._queued for t in tensors]

    def run(self) -> None:
        """W: every queued gradient computed and accumulated, the queue emptied (and
        with it everything it held), in the order the backward queued them."""
        queued, self._queued = self._queued, []
        with torch.no_grad():
            for params, compute, tensors in queued:
                for param, grad in zip(params, compute(*tensors), strict=True):
                    if param is not None and grad is not None:
                        accumulate(param, grad)


@contextlib.contextmanager
def at_once() -> Iterator[None]:
    """Around operations whose parameter gradients are never deferred: their backward
    computes them at once, in an I too. The final norm's and the head's: the head's
    gradient is made in its forward, with the loss (fused_loss.py, which never holds
    every token's logits), and I hands it to autograd; the norm's is small, and
    deferring it would keep its input and output gradient until W."""
    token = _recording.set(None)
    try:
        yield
    finally:
        _recording.reset(token)


def remember(ctx, *params: torch.Tensor | None) -> None:
    """Called by a split-aware Function's forward: the parameters among its inputs
    (None for an absent bias) and the WeightGrads its forward runs under, if any."""
    ctx.weight_grads = _recording.get()
    ctx.params = params


def deferring(ctx) -> bool:
    """Whether this backward is an I: its parameter gradients wait for W."""
    owner = ctx.weight_grads
    return owner is not None and owner.deferring


def param_grads(ctx, compute: Callable[..., Grads], *tensors: torch.Tensor) -> Grads:
    """What a split-aware backward returns for `ctx.params`: compute(*tensors) now, or
    during an I, Nones, with compute queued for W. `compute` returns one gradient per
    parameter and may read only `tensors` (saved activations, output gradients)."""
    wanted = [p if p is not None and p.requires_grad else None for p in ctx.params]
    if deferring(ctx):
        for p in wanted:
            if p is not None and p.grad_fn is not None:
                raise RuntimeError("a deferred weight gradient must belong to a parameter (a leaf tensor); this "
                                   "one is computed from others, so its gradient cannot wait for W")
        ctx.weight_grads.queue(wanted, compute, tensors)
        return (None,) * len(wanted)
    return tuple(g if p is not None else None for p, g in zip(wanted, compute(*tensors), strict=True))


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """param.grad += grad, as AccumulateGrad does: in place where .grad exists (the
    bucket's flat gradient buffer, whose views the parameters' .grad are), else set to
    grad in the parameter's layout."""
    if grad.dtype != param.dtype or grad.shape != param.shape:
        raise RuntimeError(f"a weight gradient of {grad.dtype} {tuple(grad.shape)} for a parameter of "
                           f"{param.dtype} {tuple(param.shape)}")
    if param.grad is not None:
        param.grad.add_(grad)
    elif grad.stride() == param.stride() and grad._base is None:
        param.grad = grad
    else:
        param.grad = torch.empty_like(param).copy_(grad)  # empty_like: the parameter's strides, not its values
