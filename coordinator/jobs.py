"""Job records: state, progress and the event history that watchers replay and follow.
Each change is written through to the job store (coordinator/job_store.py) as it is
published, so a restarted coordinator finds every job where it was."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from interleaf.coordinator.config import ConfigError, JobConfig, load_config
from interleaf.coordinator.job_store import MAX_STORED_EVENTS, MEMORY, JobStore, JobStoreError, StoredJob
from interleaf.coordinator.traces import Traces
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.job_states import FINAL_STATES

log = logging.getLogger("interleaf.coordinator")

MAX_EVENTS = MAX_STORED_EVENTS
"""Events a job keeps in memory for watchers to replay, the newest (as many as the job
store keeps, so a restart changes nothing a watcher sees); older ones are dropped and
counted (JobStatus.events_dropped). The job's status and last step stay whole."""


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
    events_dropped: int = 0
    cancel_requested: threading.Event = field(default_factory=threading.Event)
    store: JobStore | None = field(default=None, repr=False)
    traces: Traces = field(init=False, repr=False)  # written through to the store, read back from it
    # Told every event as it is published, before any watcher sees it (job_logs.JobLogs):
    # each has event(pb.JobEvent) and close().
    listeners: list = field(default_factory=list, repr=False)
    # Called once, with no lock held, after the job's final state is published
    # (JobTable: the store prunes the finished jobs beyond --keep-jobs).
    on_final: Callable[[], None] | None = field(default=None, repr=False)

    def __post_init__(self):
        self._changed = threading.Condition()
        stored = self.store is not None
        self.traces = Traces(self.store.load_traces(self.job_id) if stored else (),
                             persist=self._store_trace if stored else None,
                             profiled=(self.config.trace.torch_profiler, self.config.trace.memory_snapshot))

    def _store_trace(self, trace: pb.StepTrace) -> None:
        """A trace the store refuses (a full disk) is still served, until a restart."""
        try:
            self.store.save_trace(self.job_id, trace)
        except JobStoreError as err:
            log.error("job %s: %s; it is kept in memory only", self.job_id, err)

    @property
    def final(self) -> bool:
        return self.state in FINAL_STATES

    def status(self) -> pb.JobStatus:
        with self._changed:
            return pb.JobStatus(
                job_id=self.job_id, state=self.state, step=self.step,
                steps=self.config.train.steps, error=self.error, ranks=self.ranks,
                groups=self.groups, layout=self.layout, last=self.last,
                checkpoint=self.checkpoint, reason=self.reason, events_dropped=self.events_dropped,
            )

    def set_state(self, state: str, error: str = "", reason: str = "") -> None:
        with self._changed:
            if self.final:
                return
            self.state, self.error, self.reason = state, error, reason
        self._publish(pb.JobEvent(status=self.status()))
        if self.final and self.on_final is not None:
            self.on_final()

    def add_step(self, event: pb.StepEvent) -> None:
        with self._changed:
            self.step, self.last = event.step + 1, event
        self._publish(pb.JobEvent(step=event))

    def add_recovery(self, event: pb.RecoveryEvent) -> None:
        self._publish(pb.JobEvent(recovery=event))

    def add_grow(self, event: pb.GrowEvent) -> None:
        self._publish(pb.JobEvent(grow=event))

    def add_checkpoint(self, event: pb.CheckpointEvent) -> None:
        self._publish(pb.JobEvent(checkpoint=event))

    def add_eval(self, event: pb.EvalEvent) -> None:
        self._publish(pb.JobEvent(eval=event))

    def request_cancel(self) -> None:
        """Marks the job to stop, stored first: a coordinator that dies before the job is
        CANCELLED finishes it as CANCELLED when restarted, rather than run it again."""
        with self._changed:
            if self.final or self.cancel_requested.is_set():
                return
            try:
                if self.store is not None:
                    self.store.request_cancel(self.job_id)
            except JobStoreError as err:  # it is cancelled all the same, while this process lives
                log.error("job %s: %s", self.job_id, err)
            self.cancel_requested.set()

    def _publish(self, event: pb.JobEvent) -> None:
        with self._changed:
            try:
                self.events.append(event)
                if len(self.events) > MAX_EVENTS:
                    del self.events[0]
                    self.events_dropped += 1
                if self.store is not None:  # under the lock: stored in the order published
                    self.store.save(self.job_id, self.state, self.reason, self.error, self.step, self.checkpoint,
                                    event)
            except JobStoreError as err:  # the state in memory is right: watchers and the job go on
                log.error("job %s: %s", self.job_id, err)
            finally:
                for listener in self.listeners:  # under the lock: in the order published
                    try:
                        listener.event(event)
                    except Exception:  # a listener's failure is its own: the job goes on
                        log.exception("job %s: a listener failed on an event", self.job_id)
                self._changed.notify_all()

    def listen(self, listener) -> None:
        """`listener.event` is called with every event published from now on."""
        with self._changed:
            self.listeners.append(listener)

    def close_listeners(self) -> None:
        """The coordinator is stopping: each listener writes out what it holds."""
        with self._changed:
            listeners, self.listeners = self.listeners, []
        for listener in listeners:
            try:
                listener.close()
            except Exception:
                log.exception("job %s: closing a listener failed", self.job_id)

    def published(self) -> int:
        """Events ever published, dropped ones included: a `follow(start=...)` from here
        yields only those still to come."""
        with self._changed:
            return self.events_dropped + len(self.events)

    def follow(self, alive=lambda: True, poll_s: float = 1.0, start: int = 0):
        """Yields every event kept (the newest MAX_EVENTS) from the `start`-th published
        on, then new ones, until a final state. `index` counts every event ever published,
        dropped ones included, so a watcher that falls more than MAX_EVENTS behind skips
        those dropped meanwhile."""
        index = start
        while alive():
            with self._changed:
                while index >= self.events_dropped + len(self.events) and not self.final and alive():
                    self._changed.wait(poll_s)
                pending = self.events[max(0, index - self.events_dropped):]
                index = self.events_dropped + len(self.events)
                done = self.final
            yield from pending
            if done and index >= self.events_dropped + len(self.events):
                return


class JobTable:
    """The jobs of this coordinator and of every one before it on the same store: those
    not in memory (finished before a restart) are read from the store when asked for.
    When a job finishes, the store prunes the finished jobs beyond its keep_jobs
    (--keep-jobs) and the table forgets them too: asked for again, they are not found."""

    def __init__(self, store: JobStore | None = None):
        self._lock = threading.Lock()
        self._jobs: dict[str, JobRecord] = {}
        self.store = store or JobStore(MEMORY)
        self._forgetters: list[Callable[[list[str]], None]] = []

    def create(self, config: JobConfig, config_toml: str = "", overrides: list[str] = ()) -> JobRecord:
        with self._lock:
            # N is one more than any job's in the store: ids never repeat across restarts.
            job_id = self.store.add(config_toml, list(overrides),
                                    lambda n: f"job-{n}-{int(time.time()) % 100000:05d}")
            record = JobRecord(job_id, config, store=self.store, on_final=self.prune)
            self._jobs[job_id] = record
            return record

    def get(self, job_id: str) -> JobRecord | None:
        with self._lock:
            record = self._jobs.get(job_id)
            if record is None and (stored := self.store.load(job_id)) is not None:
                record = self._jobs[job_id] = _restore(stored, self.store)
                record.on_final = self.prune  # after _restore: its own set_state runs under this lock
            return record

    def unfinished(self) -> list[JobRecord]:
        """The jobs a previous coordinator left neither finished nor failed, oldest first."""
        return [self.get(job_id) for job_id in self.store.unfinished(FINAL_STATES)]

    def on_pruned(self, forget: Callable[[list[str]], None]) -> None:
        """`forget(job_ids)` is called with the jobs each prune removed (their drivers,
        their metrics' series go with them)."""
        self._forgetters.append(forget)

    def prune(self) -> None:
        gone = self.store.prune()
        if not gone:
            return
        with self._lock:
            for job_id in gone:
                self._jobs.pop(job_id, None)
        for forget in self._forgetters:
            forget(gone)


def _restore(stored: StoredJob, store: JobStore) -> JobRecord:
    """A stored job as a record, with its stored events to replay. A config that no
    longer loads (this coordinator is newer and its rules stricter) fails the job."""
    try:
        config, error = load_config(stored.config_toml, stored.overrides), ""
    except ConfigError as err:
        config, error = JobConfig(), f"its config no longer loads after the coordinator restarted: {err}"
    last = next((e.step for e in reversed(stored.events) if e.HasField("step")), None)
    record = JobRecord(stored.job_id, config, state=stored.state, step=stored.step, error=stored.error,
                       reason=stored.reason, checkpoint=stored.checkpoint, last=last, events=stored.events,
                       store=store)
    if stored.cancel_requested:
        record.cancel_requested.set()
    if error:
        record.set_state("FAILED", error)
    return record
