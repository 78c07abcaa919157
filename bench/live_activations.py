"""Peak activation bytes of a torch peer's step, counted from what autograd keeps alive.

Interleaf's stage servers keep a ledger (stageserver/activation_meter.py): each chunk's
forward adds the distinct storages it leaves for its backward (every tensor autograd
saves, the chunk's input and its output, parameters excluded), and the backward that
ends the microbatch frees them. A torch.distributed.pipelining peer has no ledger, so
this counts the same kinds of storage as they live and die:

  - every tensor autograd saves for a backward while `counting()` is on, from its pack
    hook until autograd lets the saved tensor go (the pack hook hands autograd a detached
    alias, whose finalizer marks the release); this includes the loss function's, which
    torch's schedules run outside the stage's module;
  - each stage module's output, registered by `Metered`, until the schedule drops it
    (torch keeps it in the stage's fwd_cache until the backward, and under a split
    backward in backward_state until the weight-gradient half);

as distinct storages (deduplicated by data_ptr, counted whole, as the ledger does),
less the parameters' storages. A stage's input is not registered: its first norm saves
it, so it is counted among the saved tensors. Not counted, on either side: gradients in
flight and receive buffers (torch keeps one receive buffer per microbatch and stage for
the whole run; Interleaf's ledger counts its receive buffers as communication).

The two are the same definition, not the same instrument: Interleaf's ledger holds a
(chunk, microbatch)'s bytes whole from its forward to the end of its backward, while
this follows each storage's own lifetime, so what torch frees early (the graph above a
split backward's intermediates, dropped when its input-gradient half ends) leaves early.
The hooks cost a Python call per saved tensor and turn off autograd's check of in-place
writes to saved tensors, so a peer counts on an untimed pass only.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn


class LiveActivations:
    def __init__(self, exclude: frozenset[int]):
        self.exclude = exclude  # data_ptrs of parameter storages
        self._live: dict[int, list[int]] = {}  # data_ptr -> [bytes, references alive]
        self.bytes = 0
        self.peak = 0
        self.on = False

    def hold(self, tensor: torch.Tensor, owner: object) -> None:
        """Counts tensor's storage until `owner` (an object holding it) is collected."""
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or storage.nbytes() == 0:
            return
        entry = self._live.get(ptr)
        if entry is None:
            self._live[ptr] = [storage.nbytes(), 1]
            self.bytes += storage.nbytes()
            self.peak = max(self.peak, self.bytes)
        else:
            entry[1] += 1
        weakref.finalize(owner, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[ptr]
            self.bytes -= entry[0]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # A detached alias, not the tensor: an op saving its own output would otherwise
        # close a reference cycle through its grad_fn (see activation_meter.py).
        alias = tensor.detach()
        self.hold(tensor, alias)
        return alias

    @contextlib.contextmanager
    def counting(self):
        """Counts from zero over the block; `peak` is then the most alive at once."""
        self.bytes = self.peak = 0
        self._live.clear()
        self.on = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
                yield self
        finally:
            self.on = False


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class Metered(nn.Module):
    """A stage's module whose outputs `meter` counts while it is counting."""

    def __init__(self, inner: nn.Module, meter: LiveActivations):
        super().__init__()
        self.inner = inner
        self.meter = meter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.meter.on:
            self.meter.hold(out, out)
        return out
