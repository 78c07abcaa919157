"""Reducing per-step timings to the figures a benchmark reports, and writing them out.

Figures are taken over the steps after warm-up (the first steps pay for lazy allocation,
gloo connection set-up and torch's first-call paths), and speed is reported only as a
ratio against a peer run in the same process tree within the same minute or so:
absolute seconds on a shared 2-core machine say little on their own.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics

import torch


def steady(values: list[float], warmup: int) -> list[float]:
    """The values after the first `warmup` steps; at least one must remain."""
    if len(values) <= warmup:
        raise ValueError(f"{len(values)} steps leave nothing after {warmup} warm-up steps")
    return values[warmup:]


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


def compare(interleaf: dict, peer_steps: list[float], peer_losses: list[float], warmup: int) -> dict:
    """Interleaf's run (interleaf_run.run_job) against its peer's per-step times and losses.

    ratio: median Interleaf step over median peer step, below 1 when Interleaf is faster.
    best_ratio: the same over each side's fastest steady step; other processes on a
    shared machine only ever add time, so it is the steadier of the two there.
    control fraction: coordinator time outside the servers' steps over step time; the
    median says what a typical step pays, the mean (sum over sum) also counts what is
    paid once per block of steps (the RunSteps call).
    """
    ours, control = steady(interleaf["step_seconds"], warmup), steady(interleaf["control_seconds"], warmup)
    peer = steady(peer_steps, warmup)
    return {
        "interleaf_step_seconds": statistics.median(ours),
        "peer_step_seconds": statistics.median(peer),
        "ratio": statistics.median(ours) / statistics.median(peer),
        "best_ratio": min(ours) / min(peer),
        "control_fraction_median": statistics.median(control) / statistics.median(ours),
        "control_fraction_mean": sum(control) / sum(ours),
        "max_relative_loss_difference": max_relative_difference(interleaf["losses"], peer_losses),
        "interleaf": interleaf,
        "peer": {"step_seconds": peer_steps, "losses": peer_losses},
    }


def comparison_table(peer: str, labelled: list[tuple[str, dict]]) -> str:
    """One row per (label, compare() result)."""
    headers = ["", "interleaf s/step", f"{peer} s/step", "ratio", "best-step ratio",
               "control (median)", "control (mean)", "loss rel. diff"]
    rows = [
        [label, f"{r['interleaf_step_seconds']:.3f}", f"{r['peer_step_seconds']:.3f}", f"{r['ratio']:.2f}",
         f"{r['best_ratio']:.2f}", f"{r['control_fraction_median']:.4f}", f"{r['control_fraction_mean']:.4f}",
         f"{r['max_relative_loss_difference']:.1e}"]
        for label, r in labelled
    ]
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def write_json(path: str, payload: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)
        f.write("\n")


def machine() -> dict:
    """When and where a run was made. The load average shows whether other processes
    competed for the cores: taken before a benchmark starts, anything well above 0
    means they did; taken after, the benchmark's own two busy processes count ~2."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }


def arguments(description: str, name: str) -> argparse.Namespace:
    """The options every benchmark takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=8, help="training steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", f"{name}.json"))
    return parser.parse_args()
