"""train.compile: each transformer block of a chunk through `torch.compile`, as
torchtitan compiles per block.

Per block rather than the chunk: every block of a model has the same code and shapes,
so one compiled graph serves them all (nn.Module.compile keeps the parameters' names,
which checkpoints and buckets go by), and the embedding, head and loss between
pipeline messages stay eager - all but the loss's softmax arithmetic, which fused_loss.py
runs through three small compiled functions between its matrix products. Inside the
graph the split-aware operations are plain torch ones (param_ops.py), and the
tensor-parallel collectives custom operators that call the group (traced_collectives.py),
so a tensor-parallel block compiles whole.
Full recompute wraps the compiled block as it wraps an eager one (recompute.py) and
reruns it. Selective recompute compiles the block together with its checkpoint
(recompute.SelectiveCheckpointed, torchtitan's order), so that inductor's partitioner
sees the policy: the backward reruns the norms, activations and float8 casts inside the
compiled graph, never a matrix product nor a collective. A compiled block keeps for its backward what inductor's
partitioner chooses, which the memory model counts (coordinator/activation_bytes.py,
compiled_block_bytes, compiled_selective_block_bytes).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from interleaf.stageserver.model import traced_collectives
from interleaf.stageserver.model.recompute import SelectiveCheckpointed

if TYPE_CHECKING:
    from interleaf.stageserver.model.chunk import ModelChunk


RECOMPILE_LIMIT = 64
"""Compiled versions a compiled function's code may have in a server process (blocks and
the loss's functions alike): one per job shape a server meets, where dynamo's default,
8, would turn later jobs' functions eager (blocks: fail them instead,
BlockRecompute.compiled)."""


def compile_blocks(chunk: ModelChunk) -> None:
    """Compiles each of the chunk's blocks (chunk.h, a ModuleDict) in place, on its first
    call, and, where the chunk has the head, its loss's per-chunk softmax arithmetic
    (fused_loss.py: the matrix products and the collectives stay outside the graphs).
    A block under selective recompute is compiled together with its checkpoint instead (recompute.SelectiveCheckpointed), so that the
    policy reaches the graph; the chunk's tensor group is registered for the traced
    collectives (traced_collectives.register). Its
    forward equals the plain compiled block's bit for bit and its gradients to rounding;
    a float8 block's products differ from the plain compiled one's by float8 rounding
    (inductor fuses the casts and scales otherwise, as the plain compiled block's differ
    from eager's), tests/test_compiled_activation_bytes.py."""
    recompute = chunk.recompute
    whole: dict[int, SelectiveCheckpointed] = {}
    blocks = chunk.get_submodule("h")
    assert isinstance(blocks, nn.ModuleDict)
    traced_collectives.register(chunk.tp)  # its collectives become graph nodes, not breaks
    # A long-lived server compiles each job's blocks (a version per precision, shape,
    # group, grad mode): past dynamo's default of 8 versions a block would run eager,
    # and an eager block may order its collectives otherwise than its tensor peers'
    # compiled ones (inductor schedules a gather that reads only a kept input early):
    # past the limit, a block's call fails with dynamo's error rather than pair them
    # wrongly (BlockRecompute.compiled).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    for index, block in blocks.items():
        if recompute.mode(int(index)) == "selective":
            whole[int(index)] = SelectiveCheckpointed(block)
            whole[int(index)].compile(dynamic=False)
        else:
            # Static shapes: a graph per shape, the same on every tensor rank whatever
            # shapes each server met before (a dynamic variant may order its collectives
            # otherwise than a static one)
            block.compile(dynamic=False)
    chunk.recompute = dataclasses.replace(recompute, compiled_selective=whole, compiled=True)
    chunk.compiled_loss = True
