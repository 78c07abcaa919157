"""train.compile: each transformer block of a chunk through `torch.compile`, as
torchtitan compiles per block.

Per block rather than the chunk: every block of a model has the same code and shapes,
so one compiled graph serves them all (nn.Module.compile keeps the parameters' names,
which checkpoints and buckets go by), and the embedding, head and loss between
pipeline messages stay eager - all but the loss's softmax arithmetic, which fused_loss.py
runs through three small compiled functions between its matrix products. Inside the graph the split-aware operations are plain
torch ones (param_ops.py); the tensor-parallel collectives, which go through groups
torch's compiler does not see, break the graph and run eager between its pieces.
Recompute wraps the compiled block as it wraps an eager one (recompute.py): full
reruns it, selective keeps what the policy keeps of it - which is less than of an eager
block, since the policy sees the graph's call into attention but not the matrix
products inside it, which the backward then reruns. A compiled block keeps for its
backward what inductor's partitioner chooses, which the memory model counts
(coordinator/activation_bytes.py, compiled_block_bytes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from interleaf.stageserver.model.chunk import ModelChunk


def compile_blocks(chunk: ModelChunk) -> None:
    """Compiles each of the chunk's blocks (chunk.h, a ModuleDict) in place, on its first
    call, and, where the chunk has the head, its loss's per-chunk softmax arithmetic
    (fused_loss.py: the matrix products and the collectives stay outside the graphs)."""
    blocks = chunk.get_submodule("h")
    for block in blocks.children():
        block.compile()
    chunk.compiled_loss = True
