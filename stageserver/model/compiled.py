"""train.compile: each transformer block of a chunk through `torch.compile`, as
torchtitan compiles per block.

Per block rather than the chunk: every block of a model has the same code and shapes,
so one compiled graph serves them all (nn.Module.compile keeps the parameters' names,
which checkpoints and buckets go by), and the embedding, head and loss between
pipeline messages stay eager. Inside the graph the split-aware operations are plain
torch ones (param_ops.py); the tensor-parallel collectives, which go through groups
torch's compiler does not see, break the graph and run eager between its pieces.
Recompute wraps the compiled block as it wraps an eager one (recompute.py): full
reruns it, selective keeps what the policy keeps of it.
"""

from __future__ import annotations

from torch import nn


def compile_blocks(chunk: nn.Module) -> None:
    """Compiles each of the chunk's blocks (chunk.h, a ModuleDict) in place, on its first call."""
    blocks = chunk.get_submodule("h")
    for block in blocks.children():
        block.compile()
