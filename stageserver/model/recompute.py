"""Activation recompute inside a chunk's blocks (train.recompute=selective and
train.recompute_layers); train.recompute=full is chunk-level, in the executor.

selective: each block runs under torch's selective activation checkpointing
(torch.utils.checkpoint with a policy, as torchtitan's SAC does): the outputs of the
matrix multiplications and of attention are saved in the forward, everything else -
norms, activation functions, rotary embeddings, elementwise operations, the copies
between them - is kept by nothing and rerun from the block's input in the backward.
That drops the activations that are cheap to compute and large to hold (Korthikanti et
al. 2022, section 5) for a rerun of the block's cheap operations.

The tensor-parallel collectives inside an eager block (tensor_parallel.py,
sequence_parallel.py) go through gloo and NCCL groups that torch's dispatcher does not
see, so no policy can save their outputs; the block's Tape (collective_replay.py) does: its first run records
each forward collective's output (all-reduce, all-gather, reduce-scatter), and the rerun
in the backward replays them in order and communicates nothing, as Megatron's selective
recompute never reruns communication. The matrix product next to each collective is
recorded and replayed with it, as one unit: a row-parallel product with its all-reduce
or reduce-scatter, and under sequence parallelism the gather of a column-parallel input
with the products that read it. So what a block keeps is what the policy would keep
anyway, the products' outputs, and no more: never the row-parallel partial sums nor the
gathered input, temporaries of the forward (per block with tp > 1, the Tape holds the
two row-parallel outputs, [b, s, d] summed or [b, s/t, d] reduce-scattered, and under
sequence parallelism the column-parallel products too; coordinator/activation_bytes.py). A block
rerun whole (recompute_layers) keeps only its input and issues its forward collectives
again in the rerun, as full recompute does.

Compiled blocks (train.compile, compiled.py) run selective recompute inside their graph
instead: SelectiveCheckpointed, compiled whole, so that inductor's partitioner applies
the same policy, which keeps the traced collectives' outputs (traced_collectives.py) as
the Tape would.

recompute_layers = K: which blocks rerun whole is block_modes's choice
(common/model/recompute_modes.py, worked example there), shared with the coordinator's
memory model.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from interleaf.common.model.recompute_modes import block_modes
from interleaf.stageserver.model.collective_replay import Tape
from interleaf.stageserver.model.traced_collectives import COLLECTIVE_OPS

_aten = torch.ops.aten
SAVED_OPS = frozenset({
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_mm.default,  # train.precision=fp8's float8 products (model/fp8.py)
}) | COLLECTIVE_OPS  # a compiled tensor-parallel block's forward collectives (traced_collectives.py)
"""What selective recompute keeps: every matrix product (linears, attention's math path,
float8 products)
and the fused attention kernels (their output and softmax statistics)."""


def _policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if func in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_contexts():
    """The policy's checkpoint contexts, a fresh pair per forward (a plain function:
    torch.compile traces checkpoint's context_fn only when it is one, not a lambda)."""
    return create_selective_checkpoint_contexts(_policy)


class SelectiveCheckpointed(torch.nn.Module):
    """A block under selective checkpointing, to be compiled whole (torchtitan's order:
    the checkpoint wrapper first, then torch.compile of the wrapper): dynamo traces the
    checkpoint as a region of the block's graph with each operation tagged by the
    policy, so inductor's partitioner saves the matrix products and attention and
    recomputes the rest inside the compiled backward. A compiled block called inside an
    eager checkpoint (BlockRecompute's path) would show the policy only the graph's
    call, which it does not save: the backward would rerun the products too.

    The block's tensor-parallel collectives are graph nodes there (traced_collectives.py),
    since a graph break cannot fall inside a checkpointed region. Called eagerly (not
    through torch.compile; servers never let dynamo fall back to eager, compiled.py), it
    is the eager path with its Tape (selective_with_tape): a checkpoint without the Tape
    would issue the forward's collectives again in its rerun. Not a submodule of the
    chunk: the block's parameters keep their names."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return checkpoint(self.block, x, use_reentrant=False, context_fn=selective_contexts)
        return selective_with_tape(self.block, x)


class Kept:
    """What the checkpointed blocks of one forward keep for their backward: each one's
    input (held by torch's checkpoint until the backward reruns the block), what the
    policy saved (held by torch's selective-checkpoint cache) and the outputs of its
    forward collectives (held by its Tape for the rerun to replay)."""

    def __init__(self):
        self.inputs: list[weakref.ref] = []
        self.caches: list[dict] = []
        self.tapes: list[Tape] = []

    def tensors(self) -> list[torch.Tensor]:
        inputs = [t for t in (ref() for ref in self.inputs) if t is not None]
        # torch 2.13's cache: {(op, ...): {call index: the output with each tensor in a
        # _VersionWrapper, or a marker where the policy recomputes}}.
        cached = [getattr(leaf, "val", None) for cache in self.caches for calls in cache.values()
                  for output in (calls.values() if isinstance(calls, dict) else calls)  # older torch: a list
                  for leaf in tree_leaves(output)]
        recorded = [t for tape in self.tapes for t in tape.tensors()]
        return inputs + [t for t in cached if isinstance(t, torch.Tensor)] + recorded


_listening: contextvars.ContextVar[Kept | None] = contextvars.ContextVar("recompute_kept", default=None)


@contextlib.contextmanager
def kept_tensors() -> Iterator[Kept]:
    """Reports what the checkpointed blocks run inside keep (the activation meter's view:
    autograd's saved-tensor hooks see none of it)."""
    kept = Kept()
    token = _listening.set(kept)
    try:
        yield kept
    finally:
        _listening.reset(token)


@dataclass(frozen=True)
class BlockRecompute:
    """Runs a chunk's blocks as `block_modes` says."""

    recompute: str = "none"
    recompute_layers: int = 0
    compiled_selective: Mapping[int, Callable[[torch.Tensor], torch.Tensor]] = field(
        default_factory=dict, compare=False, hash=False, repr=False)
    """Block index -> its SelectiveCheckpointed, compiled (compiled.py): run in place of
    the block wherever its mode is selective."""
    compiled: bool = False
    """The blocks are compiled (compiled.py): a call past dynamo's recompile limit fails
    rather than runs them eagerly, where a tensor peer's compiled blocks may order their
    collectives otherwise."""

    def mode(self, index: int) -> str:
        """none, selective or full for block `index` (block_modes)."""
        return block_modes(range(index, index + 1), self.recompute, self.recompute_layers)[0]

    def __call__(self, index: int, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if not self.compiled:
            return self._run(index, block, x)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
            return self._run(index, block, x)

    def _run(self, index: int, block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        if index in self.compiled_selective:
            # The block compiled with its checkpoint (it wraps `block`), with grad or
            # without: it keeps what inductor's partitioner saves, which autograd's
            # saved-tensor hooks see, so nothing is added to Kept.
            return self.compiled_selective[index](x)
        mode = self.mode(index)
        if mode == "none" or not torch.is_grad_enabled():  # no graph, nothing to keep
            return block(x)
        if mode == "full":
            kept = _listening.get()
            if kept is not None:
                kept.inputs.append(weakref.ref(x))
            return checkpoint(block, x, use_reentrant=False)
        return selective_with_tape(block, x)


def selective_with_tape(block: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The block under torch's selective checkpoint, its forward collectives recorded on a
    Tape for the rerun to replay (the eager path), and what it keeps reported to
    kept_tensors' listener."""
    if not torch.is_grad_enabled():
        return block(x)
    kept = _listening.get()
    contexts = selective_contexts()
    tape = Tape()  # the block's forward collectives, which the rerun replays
    if kept is not None:
        kept.inputs.append(weakref.ref(x))
        kept.caches.append(contexts[0].storage)
        kept.tapes.append(tape)

    def run(x: torch.Tensor) -> torch.Tensor:
        with tape.running():
            return block(x)

    return checkpoint(run, x, use_reentrant=False, context_fn=lambda: contexts)
