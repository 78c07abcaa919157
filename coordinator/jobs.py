"""Job records: state, progress and the event history that watchers replay and follow."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from interleaf.coordinator.config import JobConfig
from interleaf.protos import interleaf_pb2 as pb

FINAL_STATES = ("SUCCEEDED", "FAILED", "CANCELLED")


@dataclass
class JobRecord:
    job_id: str
    config: JobConfig
    state: str = "PENDING"
    step: int = 0
    error: str = ""
    reason: str = ""
    layout: str = ""
    checkpoint: str = ""
    ranks: list = field(default_factory=list)
    groups: list = field(default_factory=list)
    last: pb.StepEvent | None = None
    events: list = field(default_factory=list)
    cancel_requested: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self):
        self._changed = threading.Condition()

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def status(self) -> pb.JobStatus:
        with self._changed:
            return pb.JobStatus(
                job_id=self.job_id, state=self.state, step=self.step,
                steps=self.config.train.steps, error=self.error, ranks=self.ranks,
                groups=self.groups, layout=self.layout, last=self.last,
                checkpoint=self.checkpoint, reason=self.reason,
            )

    def set_state(self, state: str, error: str = "", reason: str = "") -> None:
        with self._changed:
            if self.final:
                return
            self.state, self.error, self.reason = state, error, reason
        self._publish(pb.JobEvent(status=self.status()))

    def add_step(self, event: pb.StepEvent) -> None:
        with self._changed:
            self.step, self.last = event.step + 1, event
        self._publish(pb.JobEvent(step=event))

    def add_recovery(self, event: pb.RecoveryEvent) -> None:
        self._publish(pb.JobEvent(recovery=event))

    def add_checkpoint(self, event: pb.CheckpointEvent) -> None:
        self._publish(pb.JobEvent(checkpoint=event))

    def _publish(self, event: pb.JobEvent) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def follow(self, alive=lambda: True, poll_s: float = 1.0):
        """Yields every event from the first, then new ones, until a final state."""
        index = 0
        while alive():
            with self._changed:
                while index >= len(self.events) and not self.final and alive():
                    self._changed.wait(poll_s)
                pending = self.events[index:]
                index = len(self.events)
                done = self.final
            yield from pending
            if done and index >= len(self.events):
                return


class JobTable:
    def __init__(self):
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self._count = 0

    def create(self, config: JobConfig) -> JobRecord:
        with self._lock:
            self._count += 1
            job_id = f"job-{self._count}-{int(time.time()) % 100000:05d}"
            record = JobRecord(job_id, config)
            self._jobs[job_id] = record
            return record

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            return self._jobs.get(job_id)
