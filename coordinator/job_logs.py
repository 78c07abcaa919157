"""metrics.tensorboard_dir: the coordinator writes a job's TensorBoard event files itself,
for a job that no client follows (coordinator/config/metrics.py). A thread per job
follows the job's events as a watcher does and hands them to the same RunLogs that
`interleaf run --tensorboard` uses, so the files hold the same tags."""

from __future__ import annotations

import logging
import os
import threading

from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.registry import Registry
from interleaf.coordinator.run_logs import RunLogs, TensorBoardSink

log = logging.getLogger("interleaf.coordinator")


class JobLogsError(RuntimeError):
    """The job's metrics.tensorboard_dir cannot be written: the job fails at once, rather
    than train for hours with nothing recorded."""


def start_job_logs(job: JobRecord, registry: Registry) -> threading.Thread | None:
    """Starts writing the job's events from now on into tensorboard_dir/JOB_ID (after a
    coordinator restart the earlier ones are in the files already); None when the job
    asks for none. The thread ends with the job's final state."""
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

    logs = RunLogs([sink], model=job.config.model, peak_flops=peaks)
    thread = threading.Thread(target=_write, args=(job, logs, job.published()), daemon=True,
                              name=f"tensorboard-{job.job_id}")
    thread.start()
    return thread


def _write(job: JobRecord, logs: RunLogs, start: int) -> None:
    try:
        for event in job.follow(start=start):
            logs.event(event)
    except Exception:  # a full disk: the job goes on, its board stops
        log.exception("job %s: writing its TensorBoard files failed", job.job_id)
    finally:
        logs.close()
