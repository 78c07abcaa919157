"""metrics.tensorboard_dir: the coordinator writes a job's TensorBoard event files itself,
for a job that no client follows (coordinator/config/metrics.py). The job's events reach
the same RunLogs that `interleaf run --tensorboard` uses (so the files hold the same
tags) as a listener of the job: each is written, and a step's or an evaluation's flushed
to disk, while it is published and before any watcher can see it. So a client that sees
the job SUCCEEDED reads every scalar (the final state closes the files), and a
coordinator stopped or killed mid-job loses none it had published; one stopped by
SIGTERM/SIGINT closes the files of every job it holds (coordinator/main.py)."""

from __future__ import annotations

import logging
import os
import threading

from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.registry import Registry
from interleaf.coordinator.run_logs import RunLogs, TensorBoardSink
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.job_states import FINAL_STATES

log = logging.getLogger("interleaf.coordinator")


class JobLogsError(RuntimeError):
    """The job's metrics.tensorboard_dir cannot be written: the job fails at once, rather
    than train for hours with nothing recorded."""


def start_job_logs(job: JobRecord, registry: Registry) -> "JobLogs | None":
    """Writes the job's events from now on into tensorboard_dir/JOB_ID (after a
    coordinator restart the earlier ones are in the files already); None when the job
    asks for none. The files are closed with the job's final state."""
    root = job.config.metrics.tensorboard_dir
    if not root:
        return None
    folder = os.path.join(root, job.job_id)
    try:
        os.makedirs(folder, exist_ok=True)
        sink = TensorBoardSink(folder)
    except OSError as err:
        raise JobLogsError(f"metrics.tensorboard_dir={root!r}: cannot write {folder}: {err}") from None

    def peaks(status):
        by_address = {s.address: s.peak_flops for s in registry.servers()}
        return [by_address.get(r.server_address, 0.0) for r in status.ranks]

    logs = JobLogs(job.job_id, RunLogs([sink], model=job.config.model, peak_flops=peaks))
    job.listen(logs)
    return logs


class JobLogs:
    """A job's RunLogs as a listener of its events (JobRecord.listen)."""

    FLUSHED = ("step", "eval")  # the events with scalars: on disk before they are seen

    def __init__(self, job_id: str, logs: RunLogs):
        self.job_id, self.logs = job_id, logs
        self._lock = threading.Lock()
        self.closed = False

    def event(self, event: pb.JobEvent) -> None:
        with self._lock:
            if self.closed:  # a writer used after close() would start a new file
                return
            try:
                self.logs.event(event)
                kind = event.WhichOneof("event")
                if kind in self.FLUSHED:
                    self.logs.flush()
                elif kind == "status" and event.status.state in FINAL_STATES:
                    self._close()
            except Exception:  # a full disk: the job goes on, its board stops
                log.exception("job %s: writing its TensorBoard files failed", self.job_id)
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.logs.close()
            except Exception:
                log.exception("job %s: closing its TensorBoard files failed", self.job_id)
