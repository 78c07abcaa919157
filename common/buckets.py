"""Where each parameter sits in a flat buffer and which slice a data-parallel rank owns.

A chunk's parameters live in flat buffers ("buckets"), padded with zeros to a multiple
of the data-parallel size dp so that every rank owns an equal shard: rank r owns
[r*S, (r+1)*S) with S = padded/dp. ZeRO shards exactly these ranges (DESIGN.md, "ZeRO").

The tied embedding gets a bucket of its own: its two copies (first and last chunk)
then have the same padded size, so data-parallel rank r owns the same rows of both,
and their gradient shards can be summed directly after a reduce-scatter.

Per-parameter properties the optimizer and the norm need (weight decay, whether an
element counts toward the global norm) are kept as [start, end) segments of the flat
buffer, never as per-element masks: no extra bytes per parameter.

Worked example: parameters a (6 elements) and b (3), dp=4 -> padded 12, S=3;
rank 1 owns [3, 6), all of a; rank 2 owns [6, 9), all of b; rank 3 owns padding only.

The rest of a chunk is cut into buckets of at most parallel.bucket_mb of gradient
(`split_buckets`), filled from its last parameter back, the order a backward finishes
them in: a bucket's reduction can then start while the backward still computes the
gradients of the buckets before it (stageserver/bucket_readiness.py), as DDP's and
Megatron-LM's buckets do. Each bucket is padded and sharded on its own, so ZeRO's shards
and reductions are per bucket too. `chunk_buckets` puts the tied embedding's where a
backward finishes it: last in the chunk that embeds (the embedding is its first
operation), first in the one whose head reads it.
"""

from __future__ import annotations

from dataclasses import dataclass

Segments = list[tuple[int, int]]

MIB = 1 << 20


def bucket_cap_bytes(bucket_mb: float) -> int:
    """parallel.bucket_mb in bytes, as the coordinator sends it (SetupRequest.bucket_bytes):
    at least 1 (0 on the wire means no cap)."""
    return max(1, int(bucket_mb * MIB))


def starts_in_backward(elements: int, cap_bytes: int, element_bytes: int) -> bool:
    """Whether a bucket's reduction may start inside the backward: not one over the cap
    (a parameter larger than it, alone: the tied embedding or an untied head, whose
    gradient the head chunk's backward writes first). Inside the backward each bucket
    waits for the one before it, so a huge first one would hold up the rest of the
    backward; it is left to the program's reduction action instead."""
    return not cap_bytes or elements * element_bytes <= cap_bytes


def chunk_buckets(sizes: list[tuple[str, int]], tied: str, has_embedding: bool, cap_bytes: int,
                  element_bytes: int) -> list[list[str]]:
    """A chunk's buckets in the order its backward finishes them: the tied embedding
    (named `tied`, if the chunk holds it) alone, and the rest by `split_buckets`."""
    rest = split_buckets([(name, n) for name, n in sizes if name != tied], cap_bytes, element_bytes)
    if not any(name == tied for name, _ in sizes):
        return rest
    return rest + [[tied]] if has_embedding else [[tied]] + rest


def split_buckets(sizes: list[tuple[str, int]], cap_bytes: int, element_bytes: int) -> list[list[str]]:
    """The names of `sizes` ((name, elements) in forward order) cut into buckets of at most
    `cap_bytes` of gradient at `element_bytes` each, filled from the last parameter back;
    the buckets in that order (the first is the one a backward finishes first), each
    bucket's names in forward order. A parameter larger than the cap is a bucket alone;
    cap_bytes 0: one bucket.

    Worked example: a 4, b 3, c 2, d 5 elements of 4 bytes, cap 24 bytes (6 elements):
    d (5) opens the first bucket; c would make it 7, so it opens the second, which b
    fills to 5; a would make it 9 and opens the third -> [[d], [b, c], [a]].
    """
    cap = max(1, cap_bytes // element_bytes) if cap_bytes else 0
    buckets: list[list[str]] = []
    filled = 0
    for name, n in reversed(sizes):
        if not buckets or (cap and filled + n > cap):
            buckets.append([])
            filled = 0
        buckets[-1].insert(0, name)
        filled += n
    return buckets


@dataclass(frozen=True)
class BucketLayout:
    names: tuple[str, ...]
    offsets: dict[str, tuple[int, int]]
    """name -> (start, numel) in the flat buffer."""
    numel: int
    """Elements of real parameters; the rest of `padded` is zeros."""
    padded: int
    dp: int
    dp_rank: int

    @classmethod
    def build(cls, sizes: list[tuple[str, int]], dp: int, dp_rank: int) -> "BucketLayout":
        offsets, start = {}, 0
        for name, n in sizes:
            offsets[name] = (start, n)
            start += n
        padded = -(-start // dp) * dp
        return cls(tuple(name for name, _ in sizes), offsets, start, padded, dp, dp_rank)

    @property
    def shard_size(self) -> int:
        return self.padded // self.dp

    @property
    def shard(self) -> tuple[int, int]:
        """[start, end) of the flat buffer this data-parallel rank owns."""
        return self.dp_rank * self.shard_size, (self.dp_rank + 1) * self.shard_size

    def segments(self, names) -> Segments:
        """The [start, end) ranges of the given parameters, neighbours merged."""
        ranges = sorted(self.offsets[name] for name in names)
        merged: Segments = []
        for start, n in ranges:
            if merged and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], start + n)
            else:
                merged.append((start, start + n))
        return merged


def clip_segments(segments: Segments, window: tuple[int, int]) -> Segments:
    """`segments` cut to `window` and shifted so the window starts at 0: the same
    selection in the coordinates of a buffer that holds only that window (a shard)."""
    lo, hi = window
    return [(max(s, lo) - lo, min(e, hi) - lo) for s, e in segments if s < hi and e > lo]
