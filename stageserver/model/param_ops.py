"""The plain operations that read a parameter, split-aware (weight_grads.py): a linear,
a bias added after a sum, an embedding lookup, a LayerNorm and RMSNorm's scale. Each
forward is the torch operation the model used before the split, called the same way, so
its output is the same to the bit; each backward computes its input gradient itself and
hands its parameter gradients to `param_grads`, from what autograd would have saved
anyway (the activation meter counts the same storages).

The tensor-parallel linears that fuse a collective with their product are split the
same way where they live (tensor_parallel.py, sequence_parallel.py).

Inside `torch.compile` (train.compile, stageserver/model/compiled.py) each is the plain
torch operation instead: a compiled block's backward is inductor's, which cannot defer a
weight gradient, and the plain operations are what it traces and fuses. Compiled
blocks run only in programs whose backwards are whole (B), where the split-aware
backward computes what autograd's own does. So does a forward under `torch.autocast`
(the mixed precision of a plain PyTorch loop, bench/gpu/peers.py; Interleaf's servers
hold bf16 weights instead and never autocast): autocast casts a plain operation's
inputs, and would leave a Function's backward with operands of two dtypes.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from interleaf.stageserver.model.weight_grads import deferring, param_grads, remember

_aten = torch.ops.aten


def plain() -> bool:
    """Whether the plain torch operation runs instead of the split-aware one: inside
    torch.compile, or under autocast (above)."""
    return (torch.compiler.is_compiling() or torch.is_autocast_enabled("cuda")
            or torch.is_autocast_enabled("cpu"))


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.size(-1))


def weight_grad(grad: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor]:
    """F.linear(x, weight)'s weight gradient from its input and output gradient, as
    autograd's addmm backward computes it: grad^T @ x over the tokens."""
    return (_flat(grad).t().matmul(_flat(x)),)


def linear_grads(has_bias: bool, grad: torch.Tensor, x: torch.Tensor) -> tuple:
    """F.linear(x, weight, bias)'s weight and bias gradients (None without a bias): the
    bias's is grad summed over the tokens."""
    return (*weight_grad(grad, x), _flat(grad).sum(0) if has_bias else None)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        remember(ctx, weight, bias)
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        return (grad_x, *param_grads(ctx, partial(linear_grads, ctx.params[1] is not None), grad, x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, split-aware."""
    if plain():
        return F.linear(x, weight, bias)
    return _Linear.apply(x, weight, bias)


def _bias_grad(shape: torch.Size, grad: torch.Tensor) -> tuple[torch.Tensor]:
    return (grad.sum_to_size(shape),)  # autograd's reduction of a broadcast operand


class _AddBias(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        remember(ctx, bias)
        ctx.shape = bias.shape
        return y + bias

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (grad, *param_grads(ctx, partial(_bias_grad, ctx.shape), grad))


def add_bias(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """y + bias (broadcast over the tokens), split-aware: the row-parallel bias, added
    once after the partial products are summed."""
    if plain():
        return y + bias
    return _AddBias.apply(y, bias)


def _embedding_grad(rows: int, grad: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor]:
    return (_aten.embedding_dense_backward(grad, ids, rows, -1, False),)  # F.embedding's own backward


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        remember(ctx, weight)
        ctx.save_for_backward(ids)
        ctx.rows = weight.size(0)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        return (None, *param_grads(ctx, partial(_embedding_grad, ctx.rows), grad, ids))


def embedding(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.embedding (rows `ids` of `weight`), split-aware: the token table's lookup and
    gpt2's learned positions."""
    if plain():
        return F.embedding(ids, weight)
    return _Embedding.apply(ids, weight)


def _layer_norm_param_grads(shape: list[int], meta: tuple, grad: torch.Tensor, x: torch.Tensor,
                            mean: torch.Tensor, rstd: torch.Tensor) -> tuple:
    """The weight and bias gradients from aten's own kernel, asked for them alone: they
    are sums over the tokens of grad·(x - mean)·rstd and of grad, which read no weight
    or bias, so ones and zeros of their shape stand in for them."""
    (w_shape, w_dtype), bias_meta = meta
    weight = torch.ones(w_shape, dtype=w_dtype, device=x.device)
    bias = None if bias_meta is None else torch.zeros(bias_meta[0], dtype=bias_meta[1], device=x.device)
    _, grad_w, grad_b = _aten.native_layer_norm_backward(grad, x, shape, mean, rstd, weight, bias,
                                                         [False, True, bias is not None])
    return grad_w, grad_b


class _LayerNorm(torch.autograd.Function):
    """F.layer_norm, which is aten's native_layer_norm: the same call, its mean and
    rstd kept as autograd keeps them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shape: list[int], weight: torch.Tensor, bias: torch.Tensor | None,
                eps: float) -> torch.Tensor:
        remember(ctx, weight, bias)
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = shape
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        if deferring(ctx):
            grad_x = _aten.native_layer_norm_backward(grad, x, ctx.shape, mean, rstd, weight, bias,
                                                      [ctx.needs_input_grad[0], False, False])[0]
            meta = ((weight.shape, weight.dtype), None if bias is None else (bias.shape, bias.dtype))
            deferred = param_grads(ctx, partial(_layer_norm_param_grads, ctx.shape, meta), grad, x, mean, rstd)
            return grad_x, None, *deferred, None
        # B: one pass of the kernel for all three, as before the split.
        needed = [ctx.needs_input_grad[0], ctx.needs_input_grad[2], bias is not None and ctx.needs_input_grad[3]]
        grad_x, grad_w, grad_b = _aten.native_layer_norm_backward(grad, x, ctx.shape, mean, rstd, weight, bias,
                                                                  needed)
        return grad_x, None, grad_w, grad_b, None


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm (its parameters, names and forward numerics), split-aware."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if plain():
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return _LayerNorm.apply(x, list(self.normalized_shape), self.weight, self.bias, self.eps)


def _scale_grad(shape: torch.Size, grad: torch.Tensor, normed: torch.Tensor) -> tuple[torch.Tensor]:
    return ((grad * normed).sum_to_size(shape),)


class _Scale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        remember(ctx, weight)
        ctx.save_for_backward(weight, normed)
        return weight * normed

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight, normed = ctx.saved_tensors
        grad_normed = grad * weight if ctx.needs_input_grad[1] else None
        return (*param_grads(ctx, partial(_scale_grad, weight.shape), grad, normed), grad_normed)


def scale(weight: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
    """weight * normed (broadcast over the tokens), split-aware: RMSNorm's scale."""
    if plain():
        return weight * normed
    return _Scale.apply(weight, normed)
