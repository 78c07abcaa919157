"""Splitting the layers into pp*vpp chunks (Megatron-LM's virtual pipeline stages).

Chunk c holds a contiguous run of layers and lives on the pipeline rank the schedule's
placement gives it (schedule/placement.py: c % pp, or zbv's V); the first
chunk also holds the embedding, the last the final norm, head and loss. When the layers
do not divide evenly the first chunks take one extra each, since the last chunk already
carries the head and loss (the costliest single matmul in a small-vocabulary model is
cheaper than a layer, in a large one it is not: the report shows what was chosen).
parallel.layers gives each chunk's count instead (`interleaf plan` weighs a split that
takes layers off the head's chunk: planner/candidates.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from interleaf.coordinator.schedule.placement import chunk_ranks


@dataclass(frozen=True)
class Chunk:
    index: int
    layers: range
    pipeline_rank: int
    has_embedding: bool
    has_head: bool


def partition(n_layers: int, pp: int, vpp: int, schedule: str = "interleaved-1f1b",
              sizes: tuple[int, ...] = ()) -> list[Chunk]:
    """`sizes`: each chunk's layers (parallel.layers); empty: as even as they divide."""
    count = pp * vpp
    ranks = chunk_ranks(schedule, pp, vpp)
    if not 1 <= count <= n_layers:
        raise ValueError(f"cannot split {n_layers} layers into {count} non-empty chunks")
    if sizes and (len(sizes) != count or sum(sizes) != n_layers or min(sizes) < 1):
        raise ValueError(f"layers per chunk {list(sizes)} must be {count} counts >= 1 summing to {n_layers}")
    base, extra = divmod(n_layers, count)
    chunks, start = [], 0
    for c in range(count):
        size = sizes[c] if sizes else base + (1 if c < extra else 0)
        chunks.append(Chunk(c, range(start, start + size), ranks[c], c == 0, c == count - 1))
        start += size
    return chunks


def chunks_of(chunks: list[Chunk], pipeline_rank: int) -> list[Chunk]:
    return [c for c in chunks if c.pipeline_rank == pipeline_rank]


def describe(chunks: list[Chunk], pp: int) -> str:
    lines = []
    for rank in range(pp):
        parts = []
        for c in chunks_of(chunks, rank):
            parts_of_chunk = ["embedding"] * c.has_embedding
            parts_of_chunk.append(f"layers {c.layers.start}-{c.layers.stop - 1}")
            parts_of_chunk += ["head"] * c.has_head
            parts.append(f"chunk {c.index} [{' + '.join(parts_of_chunk)}]")
        lines.append(f"pipeline rank {rank}: " + ", ".join(parts))
    sizes = sorted({len(c.layers) for c in chunks})
    if len(sizes) > 1:
        lines.append(f"uneven split: chunks hold {sizes[0]}-{sizes[-1]} layers")
    return "\n".join(lines)
