"""Blends: data.source naming several token files with weights, and which file each
global sample of the data order comes from. Pure Python (no numpy), so the config layer
checks a blend with the same code that draws it.

`a.bin:0.7,b.bin:0.3` draws 70% of the samples from a.bin and 30% from b.bin. Samples
are dealt in blocks of BLOCK: each block holds exactly `apportion(weights)` samples of
every file, interleaved so that every stretch of a block holds each file close to its
share, as Megatron's blending does (each sample from the file furthest behind its
share). Every block is dealt alike, so which file global sample n comes from, and how
many samples of that file came before it, are O(1) arithmetic from any n: a resumed job
needs no history.
"""

from __future__ import annotations

import math
from typing import NamedTuple

BLOCK = 1 << 16
"""Samples per block of a blend: a file's share is honoured to within 1/BLOCK."""


class Component(NamedTuple):
    path: str  # a token file, or 'builtin'
    weight: float


def parse_source(source: str) -> list[Component]:
    """data.source as its components: one file (weight 1) or a weighted blend.

    Worked example:
        parse_source("builtin")                 -> [Component("builtin", 1.0)]
        parse_source("a.bin:0.7, b.bin:0.3")    -> [Component("a.bin", 0.7), Component("b.bin", 0.3)]
    A weight is the text after an entry's last ':' when it reads as a number, so a path
    may hold ':' but not ','. Weights need not sum to 1: shares are weight / sum.
    """
    entries = [e.strip() for e in source.split(",")]
    if not all(entries):
        raise ValueError(f"data.source={source!r} has an empty entry: name a token file (or 'builtin') "
                         f"before and after every ','")
    components = [_component(entry) for entry in entries]
    if len(components) > 1:
        for path, weight in components:
            if weight is None:
                raise ValueError(f"data.source={source!r}: {path!r} has no weight; every file of a blend "
                                 f"needs one (PATH:WEIGHT, e.g. a.bin:0.7,b.bin:0.3)")
    components = [Component(path, 1.0 if weight is None else weight) for path, weight in components]
    for path, weight in components:
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"data.source={source!r}: {path!r} has weight {weight}; weights must be "
                             f"positive finite numbers")
    weights = [c.weight for c in components]
    for (path, weight), count in zip(components, apportion(weights)):
        if count == 0:
            share = weight / max(weights) / math.fsum(w / max(weights) for w in weights)
            raise ValueError(f"data.source={source!r}: {path!r} has weight {weight}, {share:.3g} of the "
                             f"blend, below the smallest share a blend draws, 1/{BLOCK}")
    return components


def _component(entry: str) -> tuple[str, float | None]:
    path, colon, weight = entry.rpartition(":")
    if colon and path.strip():
        try:
            return path.strip(), float(weight)
        except ValueError:
            pass  # a ':' inside the path
    return entry, None


def apportion(weights: list[float], block: int = BLOCK) -> list[int]:
    """Samples of each file per block: the largest-remainder rounding of each share of
    `block`, which sums to `block` exactly.

    Worked example, weights [0.7, 0.3], block 10: quotas 7.0 and 3.0 -> [7, 3];
    weights [1, 1, 1], block 10: quotas 3.33 each, the remaining 1 to the first -> [4, 3, 3].
    """
    top = max(weights)  # scaled first, so that no sum of finite weights overflows
    total = math.fsum(w / top for w in weights)
    quotas = [w / top / total * block for w in weights]
    counts = [int(q) for q in quotas]
    # Ties (equal remainders) go to the earlier file, so the rounding is deterministic.
    by_remainder = sorted(range(len(weights)), key=lambda i: (counts[i] - quotas[i], i))
    for i in by_remainder[: block - sum(counts)]:
        counts[i] += 1
    return counts


def block_order(counts: list[int]) -> tuple[list[int], list[int]]:
    """For each position of a block: the file its sample comes from, and how many samples
    of that file the block holds before it.

    The j-th of file i's c_i samples sits at (j + 1/2) / c_i of the block (ties: the
    earlier file first), spreading each file evenly, so any stretch of the block holds
    each file within one sample of its share, as Megatron's greedy blending does.

    Worked example, counts [2, 1]: file 0 at 1/4 and 3/4, file 1 at 1/2
        -> files [0, 1, 0], ranks [0, 0, 1].
    """
    # (2j+1) / (2c) is one correctly rounded division of exact integers: equal fractions
    # give equal floats, and distinct ones (denominators <= 2*BLOCK) never collide.
    slots = sorted(((2 * j + 1) / (2 * c), i, j) for i, c in enumerate(counts) for j in range(c))
    return [i for _, i, _ in slots], [j for _, _, j in slots]
