"""The head's matmul and the vocab-parallel cross-entropy fused, a chunk of tokens at a
time, so no [tokens x V/t] tensor beyond one chunk's ever exists (the chunked loss of
Liger-Kernel's FusedLinearCrossEntropy and torchtitan's loss parallel).

Unfused, the head chunk holds every token's logits [b*s, V/t] in the compute dtype, a
float32 copy of them under bf16, and the float32 softmax that the cross-entropy keeps
for its backward: for a vocabulary large against the width, the largest tensors of a
step. Fused, the forward walks the tokens in chunks of `chunk_tokens`; for each it
makes the chunk's logits (x_c W^T, the compute dtype, as the linear did), upcasts and
masks them, takes the vocab-parallel max, sum of exponentials and target logit over
the tensor group (vocab_parallel_loss.exp_and_sums, the unfused cross-entropy's own
helpers and collectives), and turns them at once into the gradient of the mean loss,
(softmax - onehot) / n in the compute dtype, from which it adds the chunk's rows of
grad_x = grad W and its share of grad_W += grad^T x_c. Only grad_x [b*s, d] and grad_W
[V/t, d] are kept; the backward scales them by the loss's incoming gradient (the
executor's 1/microbatches) and hands them to autograd.

The chunk size (common/model/loss_chunks.py): as many tokens as keep one chunk's softmax
within CHUNK_BYTES (256 MiB) at float32 or wider - V/t fixes it, so it is the same on
every tp rank (the chunks' collectives pair up) and on every step, and the arithmetic is
deterministic. Worked example, vocabulary 50304 at t=1 in bf16: 2**28 // (50304 * 4) = 1334 tokens a chunk,
rounded down to whole tiles of 128 rows, 1280, so 8 samples of 2048 tokens (16384) run
as 12 chunks of 1280 and one of 1024. In flight per chunk: its bf16 logits (129 MB)
while they are upcast, then only their float32 copy (258 MB), which becomes the masked
logits, the softmax and the gradient in place, and with it the gradient cast back to
bf16 (129 MB); once that copy is freed, the gradient's product with the chunk's inputs,
the chunk's share of grad_W in bf16 (206 MB). Beside them, for the whole forward,
grad_W's float32 sum (412 MB), cast to bf16 at the end (206 MB more, the kept grad_W).
So the forward holds 0.66 GB over what it keeps (with the final norm's output:
coordinator/activation_bytes.py, head_loss_temporaries_bytes), where the unfused
forward held all 16384 tokens' bf16 logits and their float32
copy (4.9 GB); these temporaries are not on the memory ledger, like every forward's.
Fused, the backward keeps grad_x (67 MB) and grad_W (206 MB), where unfused it kept the
float32 softmax (3.3 GB) (coordinator/activation_bytes.py).

Tensor parallelism keeps the unfused path's collectives: every rank's grad_x is a
partial sum over its vocabulary slice, all-reduced in the backward as copy_to_tp's is,
or under sequence parallelism reduce-scattered back to this rank's tokens, the input
having been gathered in the forward as sequence_parallel.gathered_linears does.

Compiled (train.compile, `compiled=True`): a chunk's softmax arithmetic - the upcast,
the mask, the max, the exponentials and their sum, the gradient and its cast back - runs
as three compiled functions that each read the chunk's logits in the compute dtype and
write only per-token values (the row maxima; the target logits and sums of
exponentials) or the gradient in the compute dtype, with the tensor group's two
collectives between them, where eager runs about ten operations over a float32 copy of
the chunk. The same arithmetic in the same order, so the same loss and gradients to
rounding; in bf16 no float32 [chunk x V/t] tensor is written, so a chunk has in flight
its bf16 logits and gradient (2 x 129 MB in the example) where eager has the float32
copy and the bf16 gradient (258 + 129 MB). The chunk's share of grad_W is added to its
float32 sum by a fourth compiled function, in place (_accumulate), the same sum.

The head's parameter gradient is never deferred to a split backward's W (the chunk runs
this under weight_grads.at_once): it is made in the forward and returned by the
backward, into the head's .grad (the tied embedding's sums with the first chunk's wte's
as before). Under no_grad (evaluation, recompute's first forward) only the loss is
computed.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from interleaf.common.model import loss_chunks
from interleaf.stageserver.model import sequence_parallel as sp
from interleaf.stageserver.model.param_ops import plain
from interleaf.stageserver.model.tensor_parallel import vocab_parallel_logits
from interleaf.stageserver.model.vocab_parallel_loss import (
    exp_and_sums,
    global_row_max,
    local_target_ids,
    minus_onehot_,
    upcast_masked,
    vocab_parallel_cross_entropy,
)
from interleaf.stageserver.transport import Transport

def softmax_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the softmax and loss are computed in: float32, or the compute dtype where wider."""
    return dtype if torch.finfo(dtype).bits >= 32 else torch.float32


def chunk_tokens(local_vocab: int, dtype: torch.dtype) -> int:
    """Tokens per chunk for a softmax over `local_vocab` (V/t) columns in
    softmax_dtype(dtype): common/model/loss_chunks.py's rule, which the memory model
    shares."""
    return loss_chunks.chunk_tokens(local_vocab, softmax_dtype(dtype).itemsize)


def _row_max(logits: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """Each row's largest logit over this slice's real columns, in the softmax dtype."""
    return upcast_masked(logits, start, vocab_size).amax(dim=1)


def _target_and_sum(logits: torch.Tensor, row_max: torch.Tensor, local_targets: torch.Tensor,
                    outside: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """[2, n]: each row's target logit less the row max (0 where the target lies in
    another rank's slice) and its sum of exp(logit - row max), as exp_and_sums makes them."""
    shifted = upcast_masked(logits, start, vocab_size) - row_max.unsqueeze(1)
    predicted = shifted.gather(1, local_targets.unsqueeze(1)).squeeze(1).masked_fill(outside, 0.0)
    return torch.stack([predicted, shifted.exp().sum(dim=1)])


def _loss_gradient(logits: torch.Tensor, row_max: torch.Tensor, sum_exp: torch.Tensor, local_targets: torch.Tensor,
                   outside: torch.Tensor, scale: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """(softmax - onehot) * scale in the logits' dtype: the eager path's minus_onehot_
    and scaling, in the same order and roundings. The one-hot is a comparison with the
    column index, not a scatter, so that it fuses with the rest into one kernel that
    writes only the result (a scatter would need the float32 softmax written first)."""
    softmax = (upcast_masked(logits, start, vocab_size) - row_max.unsqueeze(1)).exp() / sum_exp.unsqueeze(1)
    columns = torch.arange(logits.size(1), device=logits.device)
    onehot = (columns == local_targets.unsqueeze(1)) & ~outside.unsqueeze(1)
    return ((softmax - onehot.to(softmax.dtype)) * scale).to(logits.dtype)


@functools.cache
def _compiled(fn):
    """`fn` through torch.compile, once per process. Static shapes: a job's steps have
    two chunk lengths at most, the full one and the remainder (evaluation may add its
    own), each compiled once; past dynamo's recompile limit (compiled.RECOMPILE_LIMIT)
    a function runs eager, computing the same (no collective inside it)."""
    return torch.compile(fn, dynamic=False)


def _accumulate(total: torch.Tensor, part: torch.Tensor) -> None:
    """total += part, in place: a chunk's share of grad_W (the compute dtype) into their
    float32 sum. Compiled, one kernel reads part in its own dtype and writes total where
    it is (inductor reinplaces the add), where eager's add of mixed dtypes runs a
    non-vectorised kernel: on the H200 profile of docs/gpus.md, 52 such adds took 21 ms
    of an 866 ms step, about 60% of the memory rate."""
    total.add_(part)


def _chunk_compiled(logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int, tp: Transport,
                    scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(per-token loss, gradient of the logits times `scale`, or None without a scale)
    of one chunk of logits [n, V/t] in the compute dtype, through the compiled kernels."""
    row_max = global_row_max(_compiled(_row_max)(logits, start, vocab_size), tp)
    local_targets, outside = local_target_ids(targets, start, logits.size(1))
    sums = _compiled(_target_and_sum)(logits, row_max, local_targets, outside, start, vocab_size)
    tp.all_reduce(sums)
    target_logit, sum_exp = sums
    per_token = sum_exp.log() - target_logit
    if scale is None:
        return per_token, None
    return per_token, _compiled(_loss_gradient)(logits, row_max, sum_exp, local_targets, outside, scale, start,
                                                vocab_size)


def _chunk_eager(logits: torch.Tensor, targets: torch.Tensor, start: int, vocab_size: int, tp: Transport,
                 scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """_chunk_compiled's results through eager operations: one [chunk x V/t] float32
    (float64) tensor carries the logits through exp, the softmax and the gradient, in
    place - upcast_masked's copy, or the matmul's own output where that is float32 or
    wider and unpadded - and is freed on return, once cast back."""
    dtype = logits.dtype
    exp, target_logit, sum_exp, local_targets, outside = exp_and_sums(
        upcast_masked(logits, start, vocab_size, own=True), targets, start, tp)
    del logits  # the compute-dtype logits, where exp is a float32 copy of them
    per_token = sum_exp.log() - target_logit
    if scale is None:
        return per_token, None
    grad = minus_onehot_(exp.div_(sum_exp.unsqueeze(1)), local_targets, outside)
    return per_token, grad.mul_(scale).to(dtype)  # the mean's gradient, cast back as the unfused backward does


def head_loss(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp: Transport, vocab_size: int,
              step: int, with_grads: bool, compiled: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean cross-entropy, grad_x, grad_W) of F.linear(x, weight) over every token of x
    [n, d] with targets [n] (global ids), `step` tokens at a time; weight [V/t, d] is
    this rank's vocabulary slice, ids from `vocab_size` on padding. The gradients (of
    the mean, in x's dtype; grad_x this rank's partial sum) only `with_grads`, else None.
    `compiled`: each chunk's softmax arithmetic through inductor's kernels."""
    n = x.size(0)
    if targets.numel() != n:
        raise ValueError(f"targets hold {targets.numel()} tokens but the hidden states hold {n}")
    start = tp.rank * weight.size(0)
    per_token = x.new_empty(n, dtype=softmax_dtype(x.dtype))
    grad_x = torch.empty_like(x) if with_grads else None
    # grad_W is summed over the chunks in float32 at least: each chunk's product is
    # rounded to the compute dtype once, as autograd's one product over all tokens is.
    grad_w = weight.new_zeros(weight.shape, dtype=softmax_dtype(weight.dtype)) if with_grads else None
    scale = torch.full((), 1.0 / n, dtype=per_token.dtype, device=x.device) if with_grads else None
    chunk_loss = _chunk_compiled if compiled else _chunk_eager
    accumulate = _compiled(_accumulate) if compiled else _accumulate
    for lo in range(0, n, step):
        x_c = x[lo:lo + step]
        per_token[lo:lo + step], grad = chunk_loss(F.linear(x_c, weight), targets[lo:lo + step], start, vocab_size,
                                                   tp, scale)
        if grad_x is not None and grad_w is not None and grad is not None:
            torch.mm(grad, weight, out=grad_x[lo:lo + step])
            accumulate(grad_w, grad.t().mm(x_c))
        del grad  # before the next chunk's logits exist (activation_bytes.head_loss_temporaries_bytes)
    return per_token.mean(), grad_x, None if grad_w is None else grad_w.to(weight.dtype)


class _FusedLinearCrossEntropy(torch.autograd.Function):
    """The loss with its gradients made in the forward; the backward only scales them,
    then sums grad_x over the tensor group (reduce-scatters it: sequence parallel)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp: Transport,
                vocab_size: int, sequence_parallel: bool, step: int, compiled: bool) -> torch.Tensor:
        whole = sp.gather(x, tp) if sequence_parallel else x  # a temporary: grad_x is what is kept
        loss, grad_x, grad_w = head_loss(whole.reshape(-1, whole.size(-1)), weight, targets.reshape(-1), tp,
                                         vocab_size, step, with_grads=True, compiled=compiled)
        ctx.tp, ctx.sequence_parallel, ctx.shape = tp, sequence_parallel, whole.shape
        ctx.save_for_backward(grad_x, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_x, grad_w = ctx.saved_tensors
        # Out of place: the saved gradients stay as made (a second backward of a
        # retained graph reads them again). A 0-dim grad_loss keeps their dtype.
        grad_x = (grad_x * grad_loss).view(ctx.shape)
        if ctx.sequence_parallel:
            grad_x = sp.scatter_sum(grad_x, ctx.tp)
        elif ctx.tp.size > 1:
            ctx.tp.all_reduce(grad_x)  # copy_to_tp's sum, in place: grad_x is this backward's own tensor
        return grad_x, grad_w * grad_loss, None, None, None, None, None, None


def fused_linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, tp: Transport,
                               vocab_size: int, sequence_parallel: bool = False,
                               tokens_per_chunk: int | None = None, compiled: bool = False) -> torch.Tensor:
    """Mean cross-entropy of the logits F.linear(x, weight) against `targets` [b, s]
    (global ids), as vocab_parallel_cross_entropy(vocab_parallel_logits(x, weight, tp,
    sequence_parallel), targets, tp, vocab_size) computes it, without their logits: x
    [b, s, d] is the final norm's output (sequence parallel: this rank's [b, s/t, d]),
    weight [V/t, d] this rank's head shard. `tokens_per_chunk` defaults to chunk_tokens;
    `compiled`: each chunk's softmax arithmetic through inductor (train.compile). Returns
    the same scalar on every rank."""
    sequence_parallel = sequence_parallel and tp.size > 1
    if plain():  # autocast (a peer's loop, param_ops.plain): the unfused operations, which it casts
        return vocab_parallel_cross_entropy(vocab_parallel_logits(x, weight, tp, sequence_parallel), targets, tp,
                                            vocab_size)
    step = tokens_per_chunk or chunk_tokens(weight.size(0), x.dtype)
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _FusedLinearCrossEntropy.apply(x, weight, targets, tp, vocab_size, sequence_parallel, step, compiled)
    whole = sp.gather(x, tp) if sequence_parallel else x
    return head_loss(whole.reshape(-1, whole.size(-1)), weight, targets.reshape(-1), tp, vocab_size, step,
                     with_grads=False, compiled=compiled)[0]
