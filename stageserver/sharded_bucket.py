"""One bucket of a chunk's parameters held as its ZeRO stage says (DESIGN.md, "ZeRO").

Buffers, with N the padded bucket size, S = N/dp this rank's shard, cd the compute
dtype and md the master dtype (fp32 for fp32 and bf16 jobs, fp64 for fp64 ones):

    stage  working params (cd)      gradients                     optimizer (md)
    0      N                        N (cd)                        master N*, moments 2N
    1      N                        N (cd) (+ shard S (md), bf16) master S*, moments 2S
    2      N                        N (cd) while backwards run,   master S*, moments 2S
                                    shard S (md)
    3      shard S*; N while        N (cd) while a run of         master S*, moments 2S
           gathered                 backwards runs, shard S (md)

    * when cd == md the master weights are the working parameters themselves (stage 3:
      the working shard), so they take no bytes of their own.

"Not held" buffers keep their tensor object but have their storage resized to 0 bytes
(as FSDP does): the parameters and their .grad stay views of the same storage, and
the tensors autograd saved in a forward see the parameters again once re-gathered.

Gradients are reduced in the master dtype (a bf16 job reduces fp32 copies, as
Megatron-LM's grad_reduce_in_fp32 does): the sum of dp bf16 gradients would otherwise
lose bits the fp32 master weights then keep.
"""

from __future__ import annotations

import torch
from torch import nn

from interleaf.common.buckets import BucketLayout, clip_segments
from interleaf.stageserver.memory import MemoryLedger, nbytes
from interleaf.stageserver.optim import BETAS, EPS, AdamW
from interleaf.stageserver.transport import Transport


class Pending:
    """An asynchronous collective and what to do once it has completed."""

    def __init__(self, work, finish=None):
        self.work, self.finish, self.done = work, finish, False

    def wait(self) -> None:
        self.work.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        self.done = True


def _release(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(0)


def _materialize(tensor: torch.Tensor) -> None:
    tensor.untyped_storage().resize_(tensor.numel() * tensor.element_size())


class ShardedBucket:
    def __init__(self, params: list[tuple[str, nn.Parameter]], layout: BucketLayout, zero: int,
                 compute_dtype: torch.dtype, master_dtype: torch.dtype, dp: Transport,
                 ledger: MemoryLedger, decay_names: set[str], weight_decay: float,
                 device: torch.device = torch.device("cpu"), betas: tuple[float, float] = BETAS,
                 eps: float = EPS):
        self.layout, self.zero, self.dp, self.ledger = layout, zero, dp, ledger
        self.cd, self.md, self.device = compute_dtype, master_dtype, device
        lo, hi = layout.shard
        initial = torch.zeros(layout.padded, dtype=master_dtype)
        for name, param in params:
            start, n = layout.offsets[name]
            initial[start:start + n] = param.detach().reshape(-1)
        initial = initial.to(device)
        self.params = initial.to(compute_dtype)
        self.grads = torch.zeros(layout.padded, dtype=compute_dtype, device=device)
        for name, param in params:
            start, n = layout.offsets[name]
            param.data = self.params[start:start + n].view(param.shape)
            param.grad = self.grads[start:start + n].view(param.shape)
        separate = compute_dtype != master_dtype
        # The slice of the flat buffer the optimizer updates: all of it at stage 0.
        self.window = (0, layout.padded) if zero == 0 else (lo, hi)
        if zero == 3:
            self.param_shard = self.params[lo:hi].clone()
            _release(self.params)
            self.master = initial[lo:hi].clone() if separate else self.param_shard
        else:
            self.param_shard = None
            self.master = initial[self.window[0]:self.window[1]].clone() if separate \
                else self.params[self.window[0]:self.window[1]]
        del initial
        if zero >= 2:
            _release(self.grads)
        # Stage 1 keeps the full gradient anyway: without mixed precision the reduced shard
        # goes back into this rank's slice of it, and takes no bytes of its own.
        self.shard_in_grads = zero == 1 and not separate
        if self.shard_in_grads:
            self.grad_shard = self.grads[lo:hi]
        else:
            self.grad_shard = torch.zeros(hi - lo, dtype=master_dtype, device=device) if zero else None
        self.optimizer = AdamW(self.master, clip_segments(layout.segments(decay_names), self.window),
                               weight_decay, betas, eps)
        self.gathered = zero != 3
        self.grads_held = zero < 2
        self._optimizer_grad: torch.Tensor | None = None
        ledger.add("parameters", nbytes(self.param_shard if zero == 3 else self.params))
        ledger.add("gradients", (nbytes(self.grads) if zero < 2 else 0)
                   + (nbytes(self.grad_shard) if zero and not self.shard_in_grads else 0))
        ledger.add("optimizer", self.optimizer.state_bytes + (nbytes(self.master) if separate else 0))

    # -- parameters ----------------------------------------------------------------

    def gather(self) -> Pending:
        """Fills the full working parameters from every rank's shard (stage 3: before
        the chunk's compute; stages 1/2: after the optimizer step)."""
        if self.zero == 3:
            if self.gathered:
                raise RuntimeError("parameters are already gathered")
            _materialize(self.params)
            self.ledger.add("parameters", nbytes(self.params))
            self.gathered = True
            return Pending(self.dp.all_gather(self.params, self.param_shard, async_op=True))
        # Stages 1/2: this rank's slice of the working parameters is the updated shard
        # (cast from the master weights in bf16); the gather fills in the others'.
        lo, hi = self.window
        if self.cd != self.md:
            self.params[lo:hi].copy_(self.master)
        return Pending(self.dp.all_gather(self.params, self.params[lo:hi], async_op=True))

    def release(self) -> None:
        if not self.gathered or self.zero != 3:
            raise RuntimeError("only gathered ZeRO-3 parameters can be released")
        _release(self.params)
        self.ledger.free("parameters", nbytes(self.params))
        self.gathered = False

    # -- gradients -----------------------------------------------------------------

    def zero_grad(self) -> None:
        if self.grads_held:
            self.grads.zero_()
        if self.grad_shard is not None:
            self.grad_shard.zero_()

    def hold_grads(self) -> None:
        """Stages 2/3: the full-size gradient exists from a backward until its
        reduction; autograd accumulates into it."""
        if not self.grads_held:
            _materialize(self.grads)
            self.grads.zero_()
            self.ledger.add("gradients", nbytes(self.grads))
            self.grads_held = True

    def reduce(self, inside_backward: bool = False) -> Pending:
        """Stage 0: all-reduces the full gradient. Stages 1-3: reduce-scatters it and adds
        this rank's shard of the sum to grad_shard; stages 2/3 then drop the full one (in
        bf16 at once: the master-dtype copy is what travels). `inside_backward`: started
        by the chunk's last backward while it still runs (bucket_readiness.py); the full
        gradient is then dropped when the reduction is done, in bf16 too, so that what
        a backward holds only grows as its buckets start, whichever order autograd
        finishes them in (the memory model need not know that order)."""
        source = self.grads if self.cd == self.md else self.grads.to(self.md)
        staged = 0 if source is self.grads else nbytes(source)
        out = torch.empty(self.layout.shard_size, dtype=self.md, device=self.device) if self.zero else None
        staged += nbytes(out) if self.zero else 0
        self.ledger.add("communication", staged)
        if source is not self.grads and self.zero >= 2 and not inside_backward:
            self._drop_grads()
        if self.zero == 0:
            self._optimizer_grad = source

            def done_all_reduce():
                self.ledger.free("communication", staged)
                if staged:
                    self.ledger.add("gradients", staged)  # kept for the optimizer step
            return Pending(self.dp.all_reduce(source, async_op=True), done_all_reduce)

        def done_reduce_scatter():
            if self.shard_in_grads:
                self.grad_shard.copy_(out)  # the sum replaces this rank's own part
            else:
                self.grad_shard.add_(out)
            self.ledger.free("communication", staged)
            if self.zero >= 2 and self.grads_held:
                self._drop_grads()
        return Pending(self.dp.reduce_scatter(out, source, async_op=True), done_reduce_scatter)

    def _drop_grads(self) -> None:
        _release(self.grads)
        self.ledger.free("gradients", nbytes(self.grads))
        self.grads_held = False

    def optimizer_grad(self) -> torch.Tensor:
        """The gradient the optimizer reads, over `window`: the shard at stages 1-3; at
        stage 0 the full gradient (a master-dtype copy when it was never reduced)."""
        if self.zero:
            return self.grad_shard
        if self._optimizer_grad is None:
            self._optimizer_grad = self.grads if self.cd == self.md else self.grads.to(self.md)
            if self._optimizer_grad is not self.grads:
                self.ledger.add("gradients", nbytes(self._optimizer_grad))
        return self._optimizer_grad

    def count_norm(self, segments: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The parts of optimizer_grad that this rank counts toward the global norm:
        the given segments within its own shard, so that data-parallel ranks count
        disjoint slices (replicated stage-0 gradients included)."""
        grad, lo = self.optimizer_grad(), self.window[0]
        shard = clip_segments(segments, self.layout.shard)
        offset = self.layout.shard[0] - lo
        return [grad[offset + s:offset + e] for s, e in shard]

    # -- checkpoints ---------------------------------------------------------------

    def load_state(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                   steps: int) -> None:
        """Takes a checkpoint's state, given for the whole padded bucket (state_io.py):
        the working parameters are the master weights cast (as after every step), and
        this rank keeps its window of the master weights and moments."""
        lo, hi = self.window
        master = master.to(self.device)
        if self.zero == 3:
            self.param_shard.copy_(master[lo:hi])
        else:
            self.params.copy_(master)
        if self.cd != self.md:
            self.master.copy_(master[lo:hi])
        self.optimizer.exp_avg.copy_(exp_avg[lo:hi])
        self.optimizer.exp_avg_sq.copy_(exp_avg_sq[lo:hi])
        self.optimizer.set_steps(steps)

    # -- update --------------------------------------------------------------------

    def step(self, lr: float, scale: float | torch.Tensor) -> None:
        """AdamW on this rank's window with the gradient times `scale` (the 1/dp
        average and the clipping factor in one; a device tensor on a GPU, so that no
        step waits for the norm to reach the host), then the working copy refreshed."""
        grad = self.optimizer_grad()
        if isinstance(scale, torch.Tensor) or scale != 1.0:
            grad.mul_(scale)
        self.optimizer.step(grad, lr)
        if self.cd != self.md:
            if self.zero == 0:
                self.params.copy_(self.master)
                self.ledger.free("gradients", nbytes(self._optimizer_grad))
            elif self.zero == 3:
                self.param_shard.copy_(self.master)
        self._optimizer_grad = None
