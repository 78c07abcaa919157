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


ROW_KINDS = ("step", "eval", "checkpoint", "recovery", "grow")
"""What a --metrics-out row can be: its "kind", the one key every row carries."""


class MetricsOut:
    """--metrics-out FILE.jsonl: one JSON object a line, each with a "kind" (ROW_KINDS)
    that says which of these it is. `interleaf run` and `interleaf watch` write all five;
    `interleaf reference` writes steps and evaluations. Every row also has "step", in the
    units its kind states, so rows of all kinds can be put on one axis.

    - "step": a training step (`step_row`): its 0-based "step", "loss", "tokens",
      "step_seconds", "tokens_per_second", "grad_norm", "lr"; from a cluster also
      "bubble_seconds", "idle_seconds", "ranks" (each rank's timings and memory) and, on
      the step that ends a RunSteps block, "block_steps" and "block_control_seconds".
      After a recovery the steps from the checkpoint on come again, as trained again.
    - "eval": a held-out evaluation (`eval_row`): "step" (steps completed when scored),
      "loss", "perplexity", "samples", "tokens", "seconds".
    - "checkpoint": a checkpoint saved or resumed from (`checkpoint_row`): "checkpoint"
      ("saved" or "resumed"), "step" (steps completed), "manifest", "bytes", and
      "stall_seconds" and "write_seconds" (saved) or "load_seconds" (resumed).
    - "recovery": the job set up again after losing stage servers, or after its
      coordinator restarted ("attempt" 0) (`recovery_row`): "attempt", "failure", "lost"
      (the servers' addresses), "step" (steps completed where training went on),
      "recover_seconds", "dp", "pp", "tp", "microbatches" (the layout it went on with)
      and "resized" (why that differs from the one submitted; "" if it does not).
    - "grow": parallel.elastic: a job that had gone on with fewer data-parallel replicas
      (a recovery row with "resized") grew back to its submitted layout at a checkpoint
      boundary (`grow_row`): "step" (steps completed where training went on: the
      boundary), "grow_seconds" (from the boundary until running again), "dp", "pp",
      "tp", "microbatches" (the layout it went on with: the submitted one), "from_dp"
      and "from_microbatches" (the one it left), "added" (the servers it took on) and
      "reason".
    """

    def __init__(self, path: str | None):
        self.file = open(path, "w") if path else None

    def write(self, kind: str, **fields) -> None:
        if kind not in ROW_KINDS:  # a row readers cannot tell apart is a bug here, not in them
            raise ValueError(f"kind={kind!r} must be one of {', '.join(ROW_KINDS)} for a --metrics-out row")
        if self.file:
            self.file.write(json.dumps({"kind": kind, **fields}) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def step_row(s) -> dict:
    """--metrics-out's row of a StepEvent."""
    return {"kind": "step", "step": s.step, "loss": s.loss, "tokens": s.tokens, "step_seconds": s.step_seconds,
            "tokens_per_second": s.tokens_per_second, "grad_norm": s.grad_norm, "lr": s.lr,
            "bubble_seconds": s.bubble_seconds, "idle_seconds": s.idle_seconds, **_block_control(s),
            "ranks": [{f.name: getattr(r, f.name) for f in r.DESCRIPTOR.fields} for r in s.ranks]}


def eval_row(e) -> dict:
    """--metrics-out's row of a held-out evaluation (an EvalEvent, or the reference's
    clients.api.Evaluation): `step` is the steps completed when it was scored."""
    return {"kind": "eval", "step": e.step, "loss": e.loss, "perplexity": e.perplexity, "samples": e.samples,
            "tokens": e.tokens, "seconds": e.seconds}


def checkpoint_row(c) -> dict:
    """--metrics-out's row of a CheckpointEvent."""
    seconds = ({"stall_seconds": c.stall_seconds, "write_seconds": c.write_seconds} if c.kind == "saved"
               else {"load_seconds": c.load_seconds})
    return {"kind": "checkpoint", "checkpoint": c.kind, "step": c.step, "manifest": c.manifest, "bytes": c.bytes,
            **seconds}


def recovery_row(r) -> dict:
    """--metrics-out's row of a RecoveryEvent. No "loss" key: readers that take the rows
    with a loss as the steps (and evaluations) stay right."""
    return {"kind": "recovery", "attempt": r.attempt, "failure": r.failure, "lost": list(r.lost),
            "step": r.restart_step, "recover_seconds": r.recover_seconds, "dp": r.grid.dp, "pp": r.grid.pp,
            "tp": r.grid.tp, "microbatches": r.microbatches, "resized": r.resized}


def grow_row(g) -> dict:
    """--metrics-out's row of a GrowEvent; no "loss" key, as a recovery's."""
    return {"kind": "grow", "step": g.step, "grow_seconds": g.seconds, "dp": g.grid.dp, "pp": g.grid.pp,
            "tp": g.grid.tp, "microbatches": g.microbatches, "from_dp": g.before.dp,
            "from_microbatches": g.before_microbatches, "added": list(g.added), "reason": g.reason}


def eval_line(e) -> str:
    return (f"eval after step {e.step}: loss {e.loss:.4f}, perplexity {e.perplexity:,.2f} "
            f"({e.samples} held-out samples, {e.seconds:.2f}s)")


def checkpoint_line(c) -> str:
    size = f"{c.bytes / 2**20:,.1f} MiB"
    if c.kind == "saved":
        return (f"checkpoint at step {c.step} saved: {size}, training stalled {c.stall_seconds:.3f}s, "
                f"written in {c.write_seconds:.3f}s in the background ({c.manifest})")
    return f"resumed at step {c.step}: {size} loaded in {c.load_seconds:.3f}s ({c.manifest})"


def recovery_line(r) -> str:
    """The progress output's line for a RecoveryEvent; attempt 0 is a coordinator
    restart, whose failure says so and which lost no server."""
    if r.attempt == 0:
        why = r.failure
    else:
        why = f"recovery {r.attempt}: {r.failure}" + (f" (lost {', '.join(r.lost)})" if r.lost else "")
    resized = f"; {r.resized}" if r.resized else ""
    return (f"{why}; training went on from step {r.restart_step} as dp={r.grid.dp} pp={r.grid.pp} "
            f"tp={r.grid.tp} after {r.recover_seconds:.2f}s{resized}")


def grow_line(g) -> str:
    """The progress output's line for a GrowEvent."""
    return f"{g.reason}; training went on from step {g.step} after {g.seconds:.2f}s"


def follow(client, job_id: str, steps: int, metrics: MetricsOut, logs: RunLogs | None = None) -> int:
    """Shows progress and writes metrics (and `logs`: TensorBoard, W&B) until the job
    ends; returns the exit status."""
    progress = Progress(steps)
    logs = logs or RunLogs()
    for event in client.watch(job_id):
        logs.event(event)
        if event.HasField("step"):
            s = event.step
            metrics.write(**step_row(s))
            progress.update(s.step, s.loss, s.tokens_per_second)
        elif event.HasField("eval"):
            metrics.write(**eval_row(event.eval))
            progress.evaluation(event.eval.loss, event.eval.perplexity)
            progress.note(eval_line(event.eval))
        elif event.HasField("checkpoint"):
            metrics.write(**checkpoint_row(event.checkpoint))
            progress.note(checkpoint_line(event.checkpoint))
        elif event.HasField("recovery"):
            metrics.write(**recovery_row(event.recovery))
            progress.note(recovery_line(event.recovery))
        elif event.HasField("grow"):
            metrics.write(**grow_row(event.grow))
            progress.note(grow_line(event.grow))
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
