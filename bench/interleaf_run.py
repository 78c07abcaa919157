"""The Interleaf side of a benchmark: one job on a running LocalCluster, followed to its
end through the public client, reduced to its per-step and per-block figures."""

from __future__ import annotations

import signal
import sys

from interleaf.clients.client import Client

JOB_TIMEOUT_S = 600.0

MEMORY_FIELDS = ("parameters_bytes", "gradients_bytes", "optimizer_bytes", "parameters_peak_bytes",
                 "gradients_peak_bytes", "activations_peak_bytes", "communication_peak_bytes",
                 "peak_bytes", "rss_peak_bytes", "device_peak_bytes")


def exit_cleanly_on_sigterm() -> None:
    """SIGTERM (a `timeout` around a bench: bench/gpu/session.sh) exits through Python's
    unwinding, so that `with LocalCluster(...)` stops its coordinator and servers before
    the next command starts, rather than leaving them to notice their parent's death
    while they still hold the GPU's memory."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def run_job(client: Client, overrides: list[str]) -> dict:
    """Submits a job (config = defaults + `overrides`), waits for it and returns:

    per step: step_seconds (slowest rank, inside the servers), losses, tokens,
    tokens_per_second (the coordinator's: the step's tokens over its wall time since the
    previous step completed), idle_seconds (the mean over ranks of the time each ran no
    compute action: the executed bubble) and every rank's memory (the server's ledger by kind and
    its resident-set peak over the step);
    per RunSteps block: its first step, step count, control_seconds (the coordinator's
    wall time for the block beyond the slowest rank's total inside its steps) and
    inside_seconds (the block's step_seconds summed: the time control is a share of)."""
    job = client.submit("", overrides)
    status, steps = client.wait(job.job_id, timeout_s=JOB_TIMEOUT_S)
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"interleaf job {job.job_id} {status.state}: {status.error}")
    steps = sorted(steps, key=lambda s: s.step)
    blocks = []
    for s in steps:
        if s.block_steps:
            first = s.step - s.block_steps + 1
            blocks.append({"first_step": first, "steps": s.block_steps,
                           "control_seconds": s.block_control_seconds,
                           "inside_seconds": sum(e.step_seconds for e in steps if first <= e.step <= s.step)})
    return {
        "job_id": job.job_id,
        "step_seconds": [s.step_seconds for s in steps],
        "losses": [s.loss for s in steps],
        "tokens": [s.tokens for s in steps],
        "tokens_per_second": [s.tokens_per_second for s in steps],
        "idle_seconds": [s.idle_seconds for s in steps],
        "memory": [[{"rank": r.rank, **{f: getattr(r, f) for f in MEMORY_FIELDS}} for r in s.ranks] for s in steps],
        "blocks": blocks,
    }
