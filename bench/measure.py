"""Reducing per-step timings to the figures a benchmark reports, and writing them out.

Every figure is a median over the steps after warm-up (the first steps pay for lazy
allocation, gloo connection set-up and torch's first-call paths), and speed is reported
only as a ratio against a peer run in the same process tree minutes apart at most:
absolute seconds on a shared 2-core machine say little on their own.
"""

from __future__ import annotations

import json
import os
import statistics


def steady(values: list[float], warmup: int) -> list[float]:
    """The values after the first `warmup` steps; at least one must remain."""
    if len(values) <= warmup:
        raise ValueError(f"{len(values)} steps leave nothing after {warmup} warm-up steps")
    return values[warmup:]


def median_after(values: list[float], warmup: int) -> float:
    return statistics.median(steady(values, warmup))


def slowest_rank(per_rank: list[list[float]]) -> list[float]:
    """Per step, the slowest rank's time: a step ends for everyone when its last rank
    finishes, and it is what Interleaf's step events report too."""
    return [max(times) for times in zip(*per_rank)]


def max_relative_difference(a: list[float], b: list[float]) -> float:
    """How far two runs' per-step losses drift apart: the check that both sides did
    the same computation (same weights, samples, optimizer), not just similar work."""
    if len(a) != len(b):
        raise ValueError(f"runs have {len(a)} and {len(b)} steps")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def format_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(str(c).rjust(w) for c, w in zip(line, widths)) for line in lines)


def write_json(path: str, payload: dict) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")
