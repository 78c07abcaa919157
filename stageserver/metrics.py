"""A stage server's Prometheus metrics: what each step report says about this rank.

Every figure is labelled job, rank and stage (the rank's pipeline coordinate), and
comes from the same StepReport the coordinator receives, so the two never disagree.
A server holds one job at a time; its series stay after the job ends (the last
values remain readable) and are dropped when the next job is set up.
Each service has a registry of its own: tests serve many stage servers in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from interleaf.protos import interleaf_pb2 as pb
from interleaf.common.metric_buckets import STEP_BUCKETS

LABELS = ["job", "rank", "stage"]
HELD = ("parameters", "gradients", "optimizer")
PEAKS = ("parameters", "gradients", "activations", "communication")


class StageMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, peak_flops: float = 0.0):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.job_id = ""
        self.step_seconds = Histogram(
            "interleaf_rank_step_seconds", "This rank's wall time for one training step, from its first action "
            "to its last (the job's step time is the slowest rank's).", LABELS, registry=r, buckets=STEP_BUCKETS)
        self.compute_seconds = Counter(
            "interleaf_rank_compute_seconds_total", "Seconds this rank spent in compute actions (forward, "
            "backward, optimizer step), tensor-parallel collectives inside them included.", LABELS, registry=r)
        self.blocked_seconds = Counter(
            "interleaf_rank_blocked_seconds_total", "Seconds this rank's step program waited on pipeline "
            "receives, data-parallel gradient reductions, ZeRO parameter gathers and the tied-embedding "
            "reduction (tensor-parallel collectives inside compute are not counted here). Not the bubble: "
            "data-parallel waits are in it.", LABELS, registry=r)
        self.idle_seconds = Counter(
            "interleaf_rank_idle_seconds_total", "Seconds of this rank's executed steps in which it ran no "
            "compute action (forward, backward, optimizer step): its pipeline bubble and every wait.",
            LABELS, registry=r)
        self.bubble = Gauge(
            "interleaf_pipeline_bubble_ratio", "This rank's last step: idle seconds over step seconds, the "
            "share of the executed timeline with no compute (0-1).", LABELS, registry=r)
        comm = LABELS + ["op", "group"]
        self.comm_seconds = Counter(
            "interleaf_comm_seconds_total", "Seconds this rank was held by communication, by operation and "
            "group role: a synchronous call's whole duration, an asynchronous one's waits.", comm, registry=r)
        self.comm_bytes = Counter(
            "interleaf_comm_bytes_total", "Bytes this rank's communication moved, by operation and group role: "
            "a send's or receive's tensor; all_reduce and broadcast their tensor, all_gather its full output, "
            "reduce_scatter its full input.", comm, registry=r)
        self.comm_calls = Counter(
            "interleaf_comm_operations_total", "Communication operations this rank issued, by operation and "
            "group role.", comm, registry=r)
        self.memory = Gauge(
            "interleaf_memory_bytes", "Bytes of training state this rank held at the end of its last step, by "
            "kind: parameters (its shard under ZeRO-3), gradients (a shard under ZeRO-2/3), optimizer (master "
            "weights when separate, and Adam moments).", LABELS + ["kind"], registry=r)
        self.memory_peak = Gauge(
            "interleaf_memory_peak_bytes", "The most bytes this rank held at once during its last step, by "
            "kind (parameters with ZeRO-3's gathered chunks, gradients with full-size accumulation buffers, "
            "activations, communication buffers), and all kinds together (kind=all).",
            LABELS + ["kind"], registry=r)
        self.resident_peak = Gauge(
            "interleaf_process_resident_peak_bytes", "The stage server process's resident-set high-water mark "
            "during the rank's last step (the operating system's view, beside the ledger's).", LABELS, registry=r)
        self.device_peak = Gauge(
            "interleaf_device_allocated_peak_bytes", "On a GPU: torch's allocated-bytes high-water mark during "
            "the rank's last step (0 on a CPU).", LABELS, registry=r)
        self.peak_flops = Gauge(
            "interleaf_device_peak_flops", "The peak FLOP/s this server's device is taken to have "
            "(--peak-flops, or its default): the denominator of model FLOPs utilization.", registry=r)
        self.peak_flops.set(peak_flops)
        self._per_job = [self.step_seconds, self.compute_seconds, self.blocked_seconds, self.idle_seconds,
                         self.bubble, self.comm_seconds, self.comm_bytes, self.comm_calls, self.memory,
                         self.memory_peak, self.resident_peak, self.device_peak]

    def start_job(self, job_id: str, rank: int, stage: int) -> None:
        """A job is set up here: the previous job's series go, and this one's counters
        start at 0 (so that rates see its first steps)."""
        if job_id != self.job_id:
            for metric in self._per_job:
                metric.clear()
            self.job_id = job_id
        labels = (job_id, str(rank), str(stage))
        for metric in (self.step_seconds, self.compute_seconds, self.blocked_seconds, self.idle_seconds):
            metric.labels(*labels)

    def observe(self, report: pb.StepReport, stage: int) -> None:
        labels = (report.job_id, str(report.rank), str(stage))
        self.step_seconds.labels(*labels).observe(report.step_seconds)
        self.compute_seconds.labels(*labels).inc(report.compute_seconds)
        self.blocked_seconds.labels(*labels).inc(report.comm_wait_seconds)
        self.idle_seconds.labels(*labels).inc(report.idle_seconds)
        if report.step_seconds > 0:
            self.bubble.labels(*labels).set(min(1.0, report.idle_seconds / report.step_seconds))
        for stat in report.comm:
            comm = (*labels, stat.op, stat.group)
            self.comm_seconds.labels(*comm).inc(stat.seconds)
            self.comm_bytes.labels(*comm).inc(stat.bytes)
            self.comm_calls.labels(*comm).inc(stat.calls)
        m = report.memory
        for kind in HELD:
            self.memory.labels(*labels, kind).set(getattr(m, f"{kind}_bytes"))
        for kind in PEAKS:
            self.memory_peak.labels(*labels, kind).set(getattr(m, f"{kind}_peak_bytes"))
        self.memory_peak.labels(*labels, "all").set(m.peak_bytes)
        self.resident_peak.labels(*labels).set(m.rss_peak_bytes)
        self.device_peak.labels(*labels).set(m.device_peak_bytes)
