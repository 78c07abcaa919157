"""Following a job: the progress line and the --metrics-out file."""

from __future__ import annotations

import json
import sys

from interleaf.clients.progress import Progress
from interleaf.coordinator.run_logs import RunLogs


def _block_control(s) -> dict:
    """The control-plane figures, on the step that ends a RunSteps block only."""
    if not s.block_steps:
        return {}
    return {"block_steps": s.block_steps, "block_control_seconds": s.block_control_seconds}


class MetricsOut:
    """--metrics-out: one JSON object per step ("kind": "step", its 0-based "step"), one
    per held-out evaluation ("kind": "eval", `eval_row`), and one per checkpoint saved or
    resumed from (with a `checkpoint` key: "saved" or "resumed", and its seconds)."""

    def __init__(self, path: str | None):
        self.file = open(path, "w") if path else None

    def write(self, **record) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def eval_row(e) -> dict:
    """--metrics-out's row of a held-out evaluation (an EvalEvent, or the reference's
    clients.api.Evaluation): `step` is the steps completed when it was scored."""
    return {"kind": "eval", "step": e.step, "loss": e.loss, "perplexity": e.perplexity, "samples": e.samples,
            "tokens": e.tokens, "seconds": e.seconds}


def eval_line(e) -> str:
    return (f"eval after step {e.step}: loss {e.loss:.4f}, perplexity {e.perplexity:,.2f} "
            f"({e.samples} held-out samples, {e.seconds:.2f}s)")


def checkpoint_line(c) -> str:
    size = f"{c.bytes / 2**20:,.1f} MiB"
    if c.kind == "saved":
        return (f"checkpoint at step {c.step} saved: {size}, training stalled {c.stall_seconds:.3f}s, "
                f"written in {c.write_seconds:.3f}s in the background ({c.manifest})")
    return f"resumed at step {c.step}: {size} loaded in {c.load_seconds:.3f}s ({c.manifest})"


def follow(client, job_id: str, steps: int, metrics: MetricsOut, logs: RunLogs | None = None) -> int:
    """Shows progress and writes metrics (and `logs`: TensorBoard, W&B) until the job
    ends; returns the exit status."""
    progress = Progress(steps)
    logs = logs or RunLogs()
    for event in client.watch(job_id):
        logs.event(event)
        if event.HasField("step"):
            s = event.step
            metrics.write(kind="step", step=s.step, loss=s.loss, tokens=s.tokens, step_seconds=s.step_seconds,
                          tokens_per_second=s.tokens_per_second, grad_norm=s.grad_norm, lr=s.lr,
                          bubble_seconds=s.bubble_seconds, idle_seconds=s.idle_seconds, **_block_control(s),
                          ranks=[{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields}
                                 for r in s.ranks])
            progress.update(s.step, s.loss, s.tokens_per_second)
        elif event.HasField("eval"):
            metrics.write(**eval_row(event.eval))
            progress.evaluation(event.eval.loss, event.eval.perplexity)
            progress.note(eval_line(event.eval))
        elif event.HasField("checkpoint"):
            c = event.checkpoint
            metrics.write(kind="checkpoint", checkpoint=c.kind, step=c.step, manifest=c.manifest, bytes=c.bytes,
                          **({"stall_seconds": c.stall_seconds, "write_seconds": c.write_seconds}
                             if c.kind == "saved" else {"load_seconds": c.load_seconds}))
            progress.note(checkpoint_line(c))
        elif event.status.state == "RUNNING":
            print(event.status.layout, file=sys.stderr)
    progress.close()
    status = client.status(job_id)
    if status.state != "SUCCEEDED":
        print(f"job {job_id} {status.state}: {status.error}", file=sys.stderr)
        return 1
    if status.checkpoint:
        print(f"parameters written: {status.checkpoint}", file=sys.stderr)
    return 0
