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
import subprocess

import torch

from workload import MODELS  # sibling in bench/


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


LOSS_TOLERANCE = 1e-5
"""Largest relative difference allowed between the two sides' loss at any step: the
equivalence contract's fp32 bound (DESIGN.md). Both sides do the same fp32 arithmetic in
different orders (reductions split over ranks, shards, vocab-parallel cross-entropy
against F.cross_entropy), which moves a loss by about 1e-7; a different sample, initial
weight or update moves it by orders of magnitude more."""

MIN_BLOCKS = 3
"""RunSteps blocks after warm-up that the control figures must rest on."""


def block_control(blocks: list[dict], warmup: int) -> dict:
    """The coordinator's wall time per RunSteps block beyond the slowest rank's time
    inside the block's steps, over the blocks that start after warm-up: median and max,
    in seconds and as a share of the block's step time."""
    steady_blocks = [b for b in blocks if b["first_step"] >= warmup]
    if len(steady_blocks) < MIN_BLOCKS:
        raise ValueError(f"{len(steady_blocks)} RunSteps blocks after {warmup} warm-up steps, fewer than "
                         f"{MIN_BLOCKS}: run more --steps or fewer --steps-per-call")
    seconds = [b["control_seconds"] for b in steady_blocks]
    fractions = [b["control_seconds"] / b["inside_seconds"] for b in steady_blocks]
    return {"blocks": len(steady_blocks),
            "control_seconds_median": statistics.median(seconds), "control_seconds_max": max(seconds),
            "control_fraction_median": statistics.median(fractions), "control_fraction_max": max(fractions)}


def compare(interleaf: dict, peer_steps: list[float], peer_losses: list[float], warmup: int,
            processes: tuple[int, int]) -> dict:
    """Interleaf's run (interleaf_run.run_job) against its peer's per-step times and losses.

    ratio: median Interleaf step over median peer step, below 1 when Interleaf is faster.
    best_ratio: the same over each side's fastest steady step; other processes on a
    shared machine only ever add time, so it is the steadier of the two there.
    processes: (Interleaf's, the peer's), each with one torch thread.
    control: block_control() over Interleaf's RunSteps blocks.
    losses_agree: every step's losses within LOSS_TOLERANCE of each other.
    """
    ours, peer = steady(interleaf["step_seconds"], warmup), steady(peer_steps, warmup)
    difference = max_relative_difference(interleaf["losses"], peer_losses)
    return {
        "interleaf_step_seconds": statistics.median(ours),
        "peer_step_seconds": statistics.median(peer),
        "ratio": statistics.median(ours) / statistics.median(peer),
        "best_ratio": min(ours) / min(peer),
        "processes": {"interleaf": processes[0], "peer": processes[1]},
        "control": block_control(interleaf["blocks"], warmup),
        "max_relative_loss_difference": difference,
        "losses_agree": difference <= LOSS_TOLERANCE,
        "interleaf": interleaf,
        "peer": {"step_seconds": peer_steps, "losses": peer_losses},
    }


def processes_note(r: dict) -> str:
    """'2 vs 1, peer on 1 of 2 cores' where the sides use different numbers of cores:
    a ratio between them compares the systems and the cores at once."""
    ours, peer = r["processes"]["interleaf"], r["processes"]["peer"]
    cpus = os.cpu_count() or 1
    note = f"{ours} vs {peer}"
    if min(ours, cpus) != min(peer, cpus):
        note += f", peer on {min(peer, cpus)} of {min(ours, cpus)} cores"
    return note


def _control(seconds: float, fraction: float) -> str:
    return f"{seconds * 1000:.1f} ms ({fraction:.2%})"


def comparison_table(peer: str, labelled: list[tuple[str, dict]]) -> str:
    """One row per (label, compare() result)."""
    headers = ["", "interleaf s/step", f"{peer} s/step", "ratio", "processes", "best-step ratio",
               "control/block (median)", "control/block (max)", "loss rel. diff"]
    rows = [
        [label, f"{r['interleaf_step_seconds']:.3f}", f"{r['peer_step_seconds']:.3f}", f"{r['ratio']:.2f}",
         processes_note(r), f"{r['best_ratio']:.2f}",
         _control(r["control"]["control_seconds_median"], r["control"]["control_fraction_median"]),
         _control(r["control"]["control_seconds_max"], r["control"]["control_fraction_max"]),
         f"{r['max_relative_loss_difference']:.1e}" + ("" if r["losses_agree"] else " DIFFER")]
        for label, r in labelled
    ]
    return table(headers, rows)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    lines = [headers, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines)


def fail_on_loss_disagreement(labelled: list[tuple[str, dict]]) -> None:
    """Exits non-zero, naming each comparison whose two sides' losses differ beyond
    LOSS_TOLERANCE: their timings then compare different computations. Called after
    the results are written, so the JSON holds every step's losses to look into."""
    differ = [f"{label}: max relative loss difference {r['max_relative_loss_difference']:.2e} > {LOSS_TOLERANCE:.0e}"
              for label, r in labelled if not r["losses_agree"]]
    if differ:
        raise SystemExit("the two sides did not train the same run:\n  " + "\n  ".join(differ))


def write_json(path: str, payload: dict) -> None:
    write_atomically(path, json.dumps(payload, indent=2) + "\n")


def write_atomically(path, data: str | bytes) -> None:
    """`data` as the file at `path`, whole or not at all: written beside it, then renamed
    over it, so that a bench killed mid-write (a GPU lease's `timeout`) leaves the
    previous version rather than a truncated file that breaks everything reading the
    results after it."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
    os.replace(partial, path)


def machine() -> dict:
    """When, where and on what tree a run was made. The load average shows whether other
    processes competed for the cores: taken before a benchmark starts, anything well
    above 0 means they did; taken after, the benchmark's own two busy processes count ~2.
    The tree: the checkout's commit, "+changes" where files differ from it (None outside
    a git checkout)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tree": _tree(),
    }


def _tree() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", root, *args], capture_output=True, text=True, check=True,
                              timeout=10).stdout.strip()
    try:
        commit = git("rev-parse", "--short", "HEAD")
        return commit + ("+changes" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return None


def arguments(description: str, name: str, more=None) -> argparse.Namespace:
    """The options every benchmark takes, and those `more(parser)` adds. `--out`
    defaults to results/NAME.json, NAME-llama.json for the Llama, so that the two
    architectures' runs do not overwrite each other."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--arch", choices=sorted(MODELS), default="gpt2",
                        help="the workload's architecture (workload.py: the same size either way)")
    parser.add_argument("--steps", type=int, default=8, help="training steps per run, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the figures")
    parser.add_argument("--steps-per-call", type=int, default=2,
                        help="steps per RunSteps call (block); control time is reported per block")
    parser.add_argument("--out")
    if more:
        more(parser)
    args = parser.parse_args()
    if args.out is None:
        suffix = "" if args.arch == "gpt2" else f"-{args.arch}"
        args.out = os.path.join(os.path.dirname(__file__), "results", f"{name}{suffix}.json")
    return args
