"""Megatron's vocabulary-parallel cross-entropy (Shoeybi et al. 2019, section 3) over
logits split along the vocabulary across the tensor group: only per-token scalars
cross the network (each rank's maxima, sums of exponentials and target logits), never
logits. Its helpers are shared with the fused head loss (fused_loss.py), which runs
them a chunk of tokens at a time.
"""

from __future__ import annotations

import torch

from interleaf.stageserver.transport import Transport


def upcast_masked(logits: torch.Tensor, start: int, vocab_size: int, own: bool = False) -> torch.Tensor:
    """[n, V/t] logits of this rank's vocabulary slice (ids start, start+1, ...) as the
    softmax reads them: float32 where narrower (DESIGN.md, Precision), padding columns
    of a padded vocabulary at -inf. A fresh tensor where either applies, else `logits`;
    `own`: the caller's own tensor, which may be masked in place."""
    if torch.finfo(logits.dtype).bits < 32:
        logits, own = logits.float(), True
    local_vocab = logits.size(-1)
    if start + local_vocab > vocab_size:
        # Padding rows of a padded vocabulary: their logits never enter the softmax
        # (exp(-inf) = 0), so the loss and every gradient are the unpadded model's.
        # In place only on our own copy: the logits may be autograd's output.
        padding = torch.arange(start, start + local_vocab, device=logits.device) >= vocab_size
        logits = logits.masked_fill_(padding, float("-inf")) if own else logits.masked_fill(padding, float("-inf"))
    return logits


def global_row_max(local_max: torch.Tensor, tp: Transport) -> torch.Tensor:
    """[n]: each row's largest logit over the whole vocabulary, from this rank's maxima
    over its slice. The Transport sums but has no MAX, so every rank's per-token maxima
    (n floats each) are gathered and the max taken locally: every rank then shifts by
    exactly the unsharded row maximum, so exp() cannot overflow and the math is the
    plain op's."""
    n = local_max.size(0)
    maxima = local_max.new_empty(tp.size * n)
    tp.all_gather(maxima, local_max)
    return maxima.view(tp.size, n).max(dim=0).values


def local_target_ids(targets: torch.Tensor, start: int, local_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's column in this rank's slice, 0 where it lies outside; which lie
    outside) for targets [n] (global ids) and the slice of ids start, ...,
    start + local_vocab - 1."""
    outside = (targets < start) | (targets >= start + local_vocab)
    return (targets - start).masked_fill(outside, 0), outside


def exp_and_sums(logits: torch.Tensor, targets: torch.Tensor, start: int, tp: Transport) -> tuple[torch.Tensor, ...]:
    """From upcast, masked logits [n, V/t] (overwritten: the caller's own copy) and the
    targets [n] (global ids): (exp(logits - row max), the target logit, the softmax
    denominator, the targets local to this slice, which targets lie outside it), the
    max and both sums over the whole vocabulary, i.e. all tp ranks. Only per-token
    scalars cross the network, never logits."""
    shifted = logits.sub_(global_row_max(logits.max(dim=-1).values, tp).unsqueeze(1))
    local_targets, outside = local_target_ids(targets, start, logits.size(1))
    predicted = shifted.gather(1, local_targets.unsqueeze(1)).squeeze(1)
    exp = shifted.exp_()
    # One all-reduce for both per-token sums: the target logit (only its owner
    # contributes a non-zero) and the softmax denominator.
    sums = torch.stack([predicted.masked_fill(outside, 0.0), exp.sum(dim=-1)])
    tp.all_reduce(sums)
    target_logit, sum_exp = sums
    return exp, target_logit, sum_exp, local_targets, outside


def minus_onehot_(softmax: torch.Tensor, local_targets: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """softmax - onehot(target), in place: d(CE)/d logits per token. The one-hot is
    non-zero only on the rank that owns the target's vocab slice."""
    return softmax.scatter_add_(1, local_targets.unsqueeze(1), (outside.to(softmax.dtype) - 1.0).unsqueeze(1))


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocabulary, as Megatron's
    _VocabParallelCrossEntropy (the model's head uses fused_loss.py, which never holds
    every token's logits; this is the plain op over given logits).

    Logits narrower than float32 (bf16, fp16) are upcast first: the softmax, its saved
    copy and the loss are float32 (DESIGN.md, Precision), while the gradient goes back in
    the logits' own dtype. float32 and float64 logits are used as they are."""

    @staticmethod
    def forward(ctx, logits_shard: torch.Tensor, targets: torch.Tensor, tp: Transport, vocab_size: int):
        local_vocab = logits_shard.size(-1)
        start = tp.rank * local_vocab
        flat = logits_shard.reshape(-1, local_vocab)
        logits = upcast_masked(flat, start, vocab_size)
        flat_targets = targets.reshape(-1)
        if flat_targets.numel() != logits.size(0):
            raise ValueError(
                f"targets hold {flat_targets.numel()} tokens but logits hold {logits.size(0)}"
            )
        exp, target_logit, sum_exp, local_targets, outside = exp_and_sums(
            logits.clone() if logits is flat else logits, flat_targets, start, tp)
        loss = (sum_exp.log() - target_logit).mean()

        softmax = exp.div_(sum_exp.unsqueeze(1))
        ctx.save_for_backward(softmax, local_targets, outside)
        ctx.logits_shape = logits_shard.shape
        ctx.logits_dtype = logits_shard.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_targets, outside = ctx.saved_tensors
        grad = minus_onehot_(softmax.clone(), local_targets, outside)  # d(mean CE)/d logits, times n
        grad.mul_(grad_loss / softmax.size(0))
        return grad.view(ctx.logits_shape).to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor, targets: torch.Tensor, tp: Transport, vocab_size: int | None = None
) -> torch.Tensor:
    """Mean cross-entropy over all tokens; `logits_shard` [..., Vp/tp] is this rank's
    slice of a vocabulary padded to Vp, of which ids from `vocab_size` on (default: none)
    are padding; `targets` [...] (int64) are global token ids. Returns the same scalar on
    every rank."""
    padded = logits_shard.size(-1) * tp.size
    return _VocabParallelCrossEntropy.apply(logits_shard, targets, tp, padded if vocab_size is None else vocab_size)
