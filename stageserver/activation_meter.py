"""Measures the activation bytes one (chunk, microbatch) keeps from its forward until
its backward: the figure the coordinator predicts with coordinator/activation_bytes.py.

What is counted: the distinct storages (deduplicated by `untyped_storage().data_ptr()`,
each counted as its whole `untyped_storage().nbytes()`) of
  - every tensor autograd saves for the backward during the chunk's forward and that is
    still alive when the forward returns (a saved tensor whose graph node already died is
    not kept, so it is not counted),
  - x, the chunk's input, which the executor keeps for the input gradient (or, for the
    chunk with the embedding, the token ids, a view of the sampler's window), and
  - out, the chunk's output (hidden states, or the scalar loss on the chunk with the head).
Storages that hold parameters are excluded: the caller names them, because parameters
are views of flat buffers that the memory model counts as parameters, not activations.
Whole storages, not tensor sizes, because that is what stays allocated: q, k and v are
three views of the qkv projection's one output, and a proj input can be a view of the
attention output; each of those storages is one allocation, counted once.

The pack hook copies nothing: it hands autograd back a detached alias of the tensor
(same storage, same values), so the numbers and the memory the step uses are unchanged.
Not the tensor itself: when an op saves its own output, that output -> its grad_fn -> the
packed output would be a reference cycle through C++ that no garbage collector breaks,
leaking the whole graph of a step abandoned before its backward. Note that under any
saved-tensor hooks autograd no longer detects in-place writes to saved tensors.

Selective recompute (`train.recompute=selective`, stageserver/model/recompute.py): inside
an eagerly checkpointed block autograd saves nothing (torch's checkpoint hooks take the
place of the pack hook here); what the block keeps is its input, the outputs its policy
saves and those of its forward collectives, recorded for the rerun to replay
(model/collective_replay.py), which recompute.kept_tensors reports and are counted with
the rest. A compiled block checkpointed inside its graph
(recompute.SelectiveCheckpointed, its collectives traced) is one autograd Function whose saved tensors come
through the pack hook, as any compiled block's.

Recompute (`train.recompute=full`): the forward runs under no_grad and the executor keeps
only x, so that is all `forward_no_grad` counts; for the chunk with the head the targets
are read again from the (deterministic) sampler for the rerun, not kept. The backward
reruns the forward with grad through `forward`, whose count is then the transient peak
of saved activations during that backward, equal to what the plain mode keeps; it
includes x, which recompute already holds, so the rerun adds (that count - kept).
Counts are per (chunk, microbatch): where one chunk's output is handed to the next
chunk on the same rank as its input (pp=1), both counts include that one storage.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from interleaf.stageserver.model import recompute


def parameter_storages(module: nn.Module) -> frozenset[int]:
    """The data_ptrs of the storages behind `module`'s parameters (its flat buffers)."""
    return frozenset(p.untyped_storage().data_ptr() for p in module.parameters())


def storage_bytes(tensors: Iterable[torch.Tensor], exclude: frozenset[int] = frozenset()) -> int:
    """Bytes of the distinct storages behind `tensors`, less those in `exclude`."""
    sizes = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = storage.nbytes()
    return sum(n for ptr, n in sizes.items() if ptr not in exclude)


class ActivationMeter:
    """Runs one chunk's forward and reports the activation bytes it leaves behind.

    `param_storages`: data_ptrs of the storages holding the chunk's parameters (see
    `parameter_storages`), which are not activations."""

    def __init__(self, param_storages: Iterable[int]):
        self.exclude = frozenset(param_storages)

    def forward(
        self, chunk: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """(out, bytes kept until the backward) for a forward that builds the graph."""
        # Weak references: a tensor saved by a node that dies before the forward ends
        # (a branch out does not depend on) is freed by autograd and must not count.
        saved: list[weakref.ref] = []

        @torch.compiler.disable  # a hook, not model code: dynamo would recompile it per call (len(saved))
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            alias = tensor.detach()
            saved.append(weakref.ref(alias))
            return alias

        with torch.autograd.graph.saved_tensors_hooks(pack, _unpack), recompute.kept_tensors() as checkpointed:
            out = _call(chunk, x, targets)
        alive = [t for t in (ref() for ref in saved) if t is not None]
        return out, storage_bytes([*alive, *checkpointed.tensors(), x, out], self.exclude)

    def forward_no_grad(
        self, chunk: nn.Module, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """(out, bytes kept until the backward) for recompute: only x is kept."""
        with torch.no_grad():
            out = _call(chunk, x, targets)
        return out, storage_bytes([x], self.exclude)


class ChunkActivations:
    """Runs chunks' forwards with their activation bytes. A chunk's count is the same for
    every microbatch and step (the same shapes), so the meter, whose hooks cost a Python
    call per saved tensor and turn off autograd's check for in-place writes to saved
    tensors, runs on each chunk's first forward of each kind only; later ones reuse its
    figure."""

    def __init__(self):
        self._bytes: dict[tuple[int, bool], int] = {}  # (chunk, with graph) -> bytes

    def forward(self, chunk: nn.Module, index: int, x: torch.Tensor, targets: torch.Tensor | None,
                keep_graph: bool, local_input: bool) -> tuple[torch.Tensor, int]:
        """(out, bytes kept); `local_input`: x is the previous chunk's output, counted there."""
        key = (index, keep_graph)
        if key in self._bytes:
            with torch.enable_grad() if keep_graph else torch.no_grad():
                return _call(chunk, x, targets), self._bytes[key]
        exclude = parameter_storages(chunk)
        if local_input:
            exclude |= {x.untyped_storage().data_ptr()}
        meter = ActivationMeter(exclude)
        out, kept = (meter.forward if keep_graph else meter.forward_no_grad)(chunk, x, targets)
        self._bytes[key] = kept
        return out, kept


@torch.compiler.disable
def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _call(chunk: nn.Module, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    return chunk(x) if targets is None else chunk(x, targets)
