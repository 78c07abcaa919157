"""The coordinator's Prometheus metrics: each job's progress as its watchers see it
(every StepEvent, CheckpointEvent, RecoveryEvent and GrowEvent, and the layout each
RUNNING status names), the stage servers by state and the jobs by state.

Job figures are read from the jobs' event histories when scraped (`update`): no thread
and no hook in the driver, and a job resumed after a restart replays its history into
the counters of the new process. Per-rank figures (bubble, communication, memory) come
from the stage servers' own endpoints, found through /sd (coordinator/http_server.py).
"""

from __future__ import annotations

import threading
from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily

from interleaf.coordinator.flops import utilization
from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.registry import DEAD_AFTER_S, FORGET_DEAD_AFTER_S, Registry
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.job_states import JOB_STATES
from interleaf.common.metric_buckets import STEP_BUCKETS

SERVER_STATES = ("IDLE", "BUSY", "DEAD")


class _States:
    """Stage servers and jobs by state, counted when scraped."""

    def __init__(self, servers: Registry, jobs: Callable[[], Iterable[JobRecord]]):
        self.servers, self.jobs = servers, jobs

    def collect(self):
        servers = GaugeMetricFamily("interleaf_stage_servers", "Stage servers registered with this coordinator, "
                                    "by state: IDLE (heartbeating, no job), BUSY (holding a job), DEAD (no "
                                    f"heartbeat for {DEAD_AFTER_S:.0f} s, not yet forgotten: one with no job "
                                    f"is {FORGET_DEAD_AFTER_S:.0f} s later).", labels=["state"])
        counts = {state: 0 for state in SERVER_STATES}
        for entry in self.servers.servers():
            counts[entry.state] += 1
        for state, n in counts.items():
            servers.add_metric([state], n)
        yield servers
        jobs = GaugeMetricFamily("interleaf_jobs", "Jobs this coordinator process drives or has driven, by "
                                 "state; finished ones beyond --keep-jobs are pruned and no longer counted.",
                                 labels=["state"])
        counts = {state: 0 for state in JOB_STATES}
        for record in self.jobs():
            counts[record.state] = counts.get(record.state, 0) + 1
        for state, n in counts.items():
            jobs.add_metric([state], n)
        yield jobs


class CoordinatorMetrics:
    def __init__(self, servers: Registry, jobs: Callable[[], Iterable[JobRecord]],
                 registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.servers, self.jobs = servers, jobs
        # job -> events already counted, dropped ones included: an absolute count, as
        # JobRecord.follow keeps, since a record keeps only its newest MAX_EVENTS.
        self._seen: dict[str, int] = {}
        self._updating = threading.Lock()  # two scrapes at once must not count an event twice
        r, job = self.registry, ["job"]
        r.register(_States(servers, jobs))
        self.step_seconds = Histogram(
            "interleaf_step_seconds", "A training step's time: the slowest rank's wall time for it.", job,
            registry=r, buckets=STEP_BUCKETS)
        self.tokens = Counter(
            "interleaf_tokens_total", "Tokens trained on (global batch x sequence length per step; steps run "
            "again after a recovery count again).", job, registry=r)
        self.tokens_per_second = Gauge(
            "interleaf_tokens_per_second", "The last step's tokens over the coordinator's wall time from the "
            "previous step's completion to this one's (every rank reported).", job, registry=r)
        self.loss = Gauge("interleaf_loss", "The last step's loss: the mean over the global batch.", job,
                          registry=r)
        self.grad_norm = Gauge("interleaf_grad_norm", "The last step's global gradient norm, before clipping.",
                               job, registry=r)
        self.mfu = Gauge(
            "interleaf_model_flops_utilization_ratio", "Model FLOPs utilization of the last step (0-1): model "
            "FLOPs per token (coordinator/flops.py, PaLM's accounting, recomputation not counted) x tokens per "
            "step, over the step time x the sum of the job's servers' peak FLOP/s (each server's --peak-flops). "
            "Absent when a server's peak is unknown.", job, registry=r)
        self.control = Gauge(
            "interleaf_block_control_seconds", "The last RunSteps block's control-plane time: the coordinator's "
            "wall time for the block beyond the slowest rank's time inside its steps.", job, registry=r)
        self.eval_loss = Gauge(
            "interleaf_eval_loss", "The last held-out evaluation's loss ([eval]): the mean next-token loss over "
            "every token of eval.samples held-out samples.", job, registry=r)
        self.eval_step = Gauge("interleaf_eval_step", "The last held-out evaluation: steps completed when it was "
                               "scored.", job, registry=r)
        self.saves = Counter("interleaf_checkpoints_saved_total", "Checkpoints saved (manifest written).", job,
                             registry=r)
        self.save_stall = Gauge(
            "interleaf_checkpoint_stall_seconds", "The last save: how long training waited for it (the copies "
            "out of the training buffers).", job, registry=r)
        self.save_write = Gauge(
            "interleaf_checkpoint_write_seconds", "The last save: from the copies to its manifest, in the "
            "background while training went on.", job, registry=r)
        self.save_bytes = Gauge("interleaf_checkpoint_bytes", "The last save: bytes of all its files.", job,
                                registry=r)
        self.save_step = Gauge("interleaf_checkpoint_step", "The last save: steps completed when it was taken.",
                               job, registry=r)
        self.resumes = Counter("interleaf_checkpoints_resumed_total", "Checkpoints resumed from.", job,
                               registry=r)
        self.resume_load = Gauge(
            "interleaf_checkpoint_load_seconds", "The last resume: checking the checkpoint's files and loading "
            "them into every rank.", job, registry=r)
        self.recoveries = Counter(
            "interleaf_recoveries_total", "Times the job lost stage servers and was set up again (a coordinator "
            "restart is counted in interleaf_coordinator_restarts_total instead).", job, registry=r)
        self.lost = Counter("interleaf_lost_servers_total", "Stage servers the job lost (declared dead).", job,
                            registry=r)
        self.recover_seconds = Gauge(
            "interleaf_recovery_seconds", "The last recovery: from the failure being seen until the job ran "
            "again.", job, registry=r)
        self.replicas = Gauge(
            "interleaf_data_parallel_replicas", "Data-parallel replicas the job runs with, as of its last start "
            "(RUNNING): its parallel.dp, or fewer while parallel.elastic has it shrunk.", job, registry=r)
        self.shrinks = Counter(
            "interleaf_elastic_shrinks_total", "Recoveries in which parallel.elastic had the job go on with fewer "
            "data-parallel replicas than it was submitted with.", job, registry=r)
        self.grows = Counter(
            "interleaf_elastic_grows_total", "Times parallel.elastic had the job grow back to its submitted "
            "data-parallel replicas, at a checkpoint boundary, once enough servers were free.", job, registry=r)
        self.grow_seconds = Gauge(
            "interleaf_elastic_grow_seconds", "The last growth: from its checkpoint boundary until the job ran "
            "again under the submitted layout.", job, registry=r)
        self.restarts = Counter(
            "interleaf_coordinator_restarts_total", "Times a restarted coordinator took the job over, unfinished, "
            "and set it up again from its newest checkpoint (no server lost).", job, registry=r)

        # Every metric made so far is labelled by job: a pruned job's series are these.
        self._per_job = [m for m in vars(self).values() if isinstance(m, (Counter, Gauge, Histogram))]
        self.pruned = Counter(
            "interleaf_jobs_pruned_total", "Finished jobs removed from the state database (with their events, "
            "traces and metric series) beyond the newest --keep-jobs to finish.", registry=r)

    def forget(self, job_ids: list[str]) -> None:
        """Pruned jobs (--keep-jobs): their series go, so /metrics stays bounded too."""
        with self._updating:
            for job_id in job_ids:
                self._seen.pop(job_id, None)
                for metric in self._per_job:
                    metric.remove(job_id)
            self.pruned.inc(len(job_ids))

    def update(self) -> None:
        """Counts every job's events published since the last update. Events dropped
        from a record before an update saw them (more than MAX_EVENTS in between) are
        not counted."""
        with self._updating:
            for record in list(self.jobs()):
                if record.job_id not in self._seen:  # its series start at 0, so rates see its first steps
                    self.step_seconds.labels(record.job_id)
                    self.tokens.labels(record.job_id)
                seen = self._seen.get(record.job_id, 0)
                with record._changed:  # the events and their dropped count as of one publish
                    fresh = record.events[max(0, seen - record.events_dropped):]
                    self._seen[record.job_id] = record.events_dropped + len(record.events)
                for event in fresh:
                    self._observe(record, event)

    def _observe(self, record: JobRecord, event: pb.JobEvent) -> None:
        job = record.job_id
        which = event.WhichOneof("event")
        if which == "step":
            step = event.step
            self.step_seconds.labels(job).observe(step.step_seconds)
            self.tokens.labels(job).inc(step.tokens)
            self.tokens_per_second.labels(job).set(step.tokens_per_second)
            self.loss.labels(job).set(step.loss)
            self.grad_norm.labels(job).set(step.grad_norm)
            if step.block_steps:
                self.control.labels(job).set(step.block_control_seconds)
            mfu = self.utilization(record, step)
            if mfu is not None:
                self.mfu.labels(job).set(mfu)
        elif which == "eval":
            self.eval_loss.labels(job).set(event.eval.loss)
            self.eval_step.labels(job).set(event.eval.step)
        elif which == "checkpoint":
            saved = event.checkpoint
            if saved.kind == "saved":
                self.saves.labels(job).inc()
                self.save_stall.labels(job).set(saved.stall_seconds)
                self.save_write.labels(job).set(saved.write_seconds)
                self.save_bytes.labels(job).set(saved.bytes)
                self.save_step.labels(job).set(saved.step)
            else:
                self.resumes.labels(job).inc()
                self.resume_load.labels(job).set(saved.load_seconds)
        elif which == "status":
            status = event.status
            if status.state == "RUNNING" and status.ranks:
                self.replicas.labels(job).set(1 + max(rank.coordinates.dp for rank in status.ranks))
        elif which == "grow":
            self.grows.labels(job).inc()
            self.grow_seconds.labels(job).set(event.grow.seconds)
        elif which == "recovery":
            if event.recovery.resized:
                self.shrinks.labels(job).inc()
            if event.recovery.attempt == 0:  # RecoveryEvent.attempt: 0 after a coordinator restart
                self.restarts.labels(job).inc()
                return
            self.recoveries.labels(job).inc()
            self.lost.labels(job).inc(len(event.recovery.lost))
            self.recover_seconds.labels(job).set(event.recovery.recover_seconds)

    def utilization(self, record: JobRecord, step: pb.StepEvent) -> float | None:
        """Model FLOPs of the step over step time x the job's servers' summed peak."""
        peaks = {e.address: e.peak_flops for e in self.servers.servers()}
        job_peaks = [peaks.get(rank.server_address, 0.0) for rank in record.ranks]
        return utilization(record.config.model, step.tokens, step.step_seconds, job_peaks)
