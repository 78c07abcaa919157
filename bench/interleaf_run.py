"""The Interleaf side of a benchmark: one job on a running LocalCluster, followed to its
end through the public client, reduced to its per-step figures."""

from __future__ import annotations

from clients.client import Client

JOB_TIMEOUT_S = 600.0


def run_job(client: Client, overrides: list[str]) -> dict:
    """Submits a job (config = defaults + `overrides`), waits for it and returns its
    per-step step_seconds (slowest rank, inside the servers), control_seconds
    (coordinator wall time per step beyond that) and losses."""
    job = client.submit("", overrides)
    status, steps = client.wait(job.job_id, timeout_s=JOB_TIMEOUT_S)
    if status.state != "SUCCEEDED":
        raise RuntimeError(f"interleaf job {job.job_id} {status.state}: {status.error}")
    steps = sorted(steps, key=lambda s: s.step)
    return {
        "job_id": job.job_id,
        "step_seconds": [s.step_seconds for s in steps],
        "control_seconds": [s.control_seconds for s in steps],
        "losses": [s.loss for s in steps],
    }
