"""The stage server's gRPC handlers: parse, check, serialize. The job object does the work.

A job belongs to the coordinator incarnation that set it up (common/incarnation.py):
its control calls from any other are refused with PERMISSION_DENIED, and it is dropped
when this server registers with a coordinator of another incarnation. A Setup is taken
only from the incarnation this server is registered with: a stale coordinator (replaced,
or cut off while its successor took over) cannot start a job on it either. This guards
against our own stale coordinators, not against strangers: the incarnation is no
secret to any holder of the shared token."""

from __future__ import annotations

import functools
import gc
import itertools
import logging
import pathlib
import threading

import grpc
import torch

from interleaf.common import incarnation
from interleaf.common.limits import shown
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.stageserver.job import JobRejected, StageJob
from interleaf.stageserver.metrics import StageMetrics
from interleaf.stageserver.spool import default_root, sees

log = logging.getLogger("interleaf.stageserver")


class StageServerService(rpc.StageServerServicer):
    def __init__(self, hostname: str, device: torch.device = torch.device("cpu"),
                 spool_root: pathlib.Path | None = None, metrics: StageMetrics | None = None,
                 observed: bool = True):
        """observed=False (--metrics-port -1): no metrics are kept, and the jobs' groups
        are not metered (their StepReports carry no `comm`)."""
        self.hostname = hostname
        self.metrics = (metrics or StageMetrics()) if observed else None
        self.device = device
        self.spool_root = spool_root or default_root()
        self._lock = threading.Lock()
        self._job: StageJob | None = None
        self._working = 0  # steps and evaluations under way, of any job
        self._owner = ""  # the incarnation of the coordinator that set up self._job
        # The incarnation of the coordinator this server is registered with: "" until it
        # registers, as in-process callers (tests) send none.
        self._registered = ""

    def _use_device(self) -> None:
        """gRPC runs handlers on pool threads, and a CUDA current device is per thread:
        without this, calls that take the current device would use (and make a context
        on) GPU 0 whatever --device says."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _current(self, job_id: str, context) -> StageJob:
        with self._lock:
            job, owner = self._job, self._owner
        if job is None or job.job_id != job_id:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {shown(job_id)} on this server")
        self._check_owner(job_id, owner, context)
        return job

    def _connected(self, job_id: str, context) -> StageJob:
        """The job, once Connect has built its model: steps, saves and loads need it."""
        job = self._current(job_id, context)
        if job.model is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"job {job_id!r} on this server is not connected: Connect comes before this call")
        return job

    @staticmethod
    def _check_owner(job_id: str, owner: str, context) -> None:
        caller = incarnation.of(context)
        if caller != owner:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"job {job_id!r} on this server belongs to coordinator incarnation {owner or '(none)'!r}; "
                          f"this call comes from incarnation {caller or '(none)'!r}: only the coordinator that "
                          f"set a job up controls it")

    def _setup_refused(self, job_id: str, caller: str) -> tuple[grpc.StatusCode, str] | None:
        """Why a Setup from `caller` is refused now (None if it is not); under the lock."""
        if caller != self._registered:
            return (grpc.StatusCode.PERMISSION_DENIED,
                    f"this server is registered with coordinator incarnation {self._registered or '(none)'!r}; "
                    f"a Setup from incarnation {caller or '(none)'!r} is refused: only the coordinator it is "
                    f"registered with sets jobs up on it")
        if self._job is not None and (self._job.job_id != job_id or self._owner != caller):
            return (grpc.StatusCode.FAILED_PRECONDITION,
                    f"server is busy with job {self._job.job_id} of coordinator incarnation "
                    f"{self._owner or '(none)'!r}")
        return None

    def Setup(self, request: pb.SetupRequest, context):
        self._use_device()
        caller = incarnation.of(context)
        with self._lock:
            refused = self._setup_refused(request.job_id, caller)
        if refused:
            context.abort(*refused)
        try:
            job = StageJob(request, self.hostname, self.device, self.spool_root, metered=self.metrics is not None)
        except JobRejected as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        with self._lock:
            refused = self._setup_refused(request.job_id, caller)  # registered elsewhere meanwhile
            if not refused:
                if self._job is not None:
                    self._job.close()
                self._job, self._owner = job, caller
        if refused:
            job.close()
            context.abort(*refused)
        if self.metrics is not None:
            self.metrics.start_job(job.job_id, job.rank, request.coordinates.pp)
        return pb.SetupReply(
            data_tokens=len(job.data), data_sha256=job.data.sha256, device=str(self.device),
            group_ids=[pb.GroupId(name=n, id=i) for n, i in sorted(job.group_ids.items())],
            probes_seen=[sees(p.path, p.sha256) for p in request.probes],
        )

    def Connect(self, request: pb.ConnectRequest, context):
        self._use_device()
        job = self._current(request.job_id, context)
        try:
            job.connect({g.name: g.id for g in request.group_ids})
        except Exception as err:  # a peer missing or a timeout: the job cannot start
            context.abort(grpc.StatusCode.UNAVAILABLE, f"rank {job.rank} could not connect: {err}")
        return pb.Empty()

    def RunSteps(self, request: pb.RunStepsRequest, context):
        job = self._connected(request.job_id, context)
        traced, evaluated = set(request.trace_steps), set(request.eval_after)
        for step in range(request.first_step, request.first_step + request.num_steps):
            if job.cancelled.is_set():
                context.abort(grpc.StatusCode.CANCELLED, f"job {job.job_id} was torn down")
            self._use_device()  # each step: a streaming handler may resume on another thread
            stats, stopped = self._attempt(job, context, functools.partial(job.run_step, step, trace=step in traced))
            if stopped:  # closed mid-step: torn down, dropped, or the server stopping
                log.info("job %s stopped in step %d: %s", job.job_id, step, stopped)
                _collect()  # out of the except block: the step's frames are no longer held
                context.abort(grpc.StatusCode.CANCELLED, stopped)
            report = pb.StepReport(
                job_id=job.job_id,
                step=step,
                rank=job.rank,
                has_loss=job.reports_loss,
                loss=stats.loss if job.reports_loss else 0.0,
                tokens=job.train.rows * job.train.microbatches * job.config.seq_len,
                step_seconds=stats.step_seconds,
                compute_seconds=stats.compute_seconds,
                comm_wait_seconds=stats.comm_wait_seconds,
                grad_norm=stats.grad_norm,
                lr=stats.lr,
                memory=pb.RankMemory(rank=job.rank, **stats.memory),
                idle_seconds=stats.idle_seconds,
                started_unix=stats.started_unix,
                spans=[pb.ActionSpan(action=a, kind=k, start_seconds=b, end_seconds=e) for a, k, b, e in stats.spans],
                torch_profile=stats.torch_profile,
                memory_snapshot=stats.memory_snapshot,
                comm=[pb.CommStat(op=op, group=group, seconds=seconds, bytes=size, calls=calls)
                      for op, group, seconds, size, calls in stats.comm],
            )
            if self.metrics is not None:
                self.metrics.observe(report, job.request.coordinates.pp)
            yield report
            if step in evaluated:
                # The held-out set scored with the weights this step left, after the step's
                # report has gone: the driver sees the step's progress and timings alone,
                # and this report as the evaluation's own progress (coordinator/driver.py).
                self._use_device()
                evaluation, stopped = self._attempt(job, context, job.evaluate)
                if stopped:
                    log.info("job %s stopped evaluating after step %d: %s", job.job_id, step, stopped)
                    _collect()
                    context.abort(grpc.StatusCode.CANCELLED, stopped)
                yield pb.StepReport(job_id=job.job_id, step=step, rank=job.rank,
                                    evaluation=_evaluation_report(evaluation, job.reports_loss))

    def _attempt(self, job: StageJob, context, work):
        """(work's result, "") or, when the job was closed under it (torn down, dropped,
        or the server stopping), (None, why); any other failure aborts the call."""
        with self._lock:
            self._working += 1
        try:
            return work(), ""
        except Exception as err:
            if not job.cancelled.is_set():
                context.abort(grpc.StatusCode.INTERNAL, str(err))
            return None, str(err)
        finally:
            with self._lock:
                self._working -= 1

    def working(self) -> bool:
        """Whether a step or an evaluation is under way, of any job: one still running
        after its job was closed is in a long action or waits on a peer (a closed job's
        work stops at its next action)."""
        with self._lock:
            return self._working > 0

    def SaveState(self, request: pb.SaveRequest, context):
        job = self._connected(request.job_id, context)
        self._use_device()
        digest, size = job.save_state(request.path, request.background)
        return pb.SaveReply(sha256=digest, bytes=size)

    def FinishSaves(self, request: pb.JobRef, context):
        job = self._current(request.job_id, context)
        try:
            written = job.finish_saves()
        except RuntimeError as err:
            context.abort(grpc.StatusCode.INTERNAL, f"rank {job.rank}: {err}")
        return pb.SavedFiles(files=[pb.SavedFile(path=w.path, sha256=w.sha256, bytes=w.bytes, seconds=w.seconds)
                                    for w in written])

    def ReadFile(self, request: pb.FileRef, context):
        job = self._current(request.job_id, context)
        try:
            for data in job.spool.read(request.path):
                yield pb.FileChunk(data=data)
        except (OSError, ValueError) as err:
            context.abort(grpc.StatusCode.NOT_FOUND, f"rank {job.rank} cannot read {request.path!r}: {err}")

    def WriteFile(self, request_iterator, context):
        first = next(request_iterator, None)
        if first is None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "WriteFile: an empty stream names no file")
        job = self._current(first.job_id, context)
        chunks = (c.data for c in itertools.chain([first], request_iterator))
        try:
            path, size = job.spool.receive(first.path, first.sha256, chunks)
        except (OSError, ValueError) as err:
            context.abort(grpc.StatusCode.DATA_LOSS, f"rank {job.rank} refused {first.path!r}: {err}")
        return pb.SavedFile(path=first.path, sha256=first.sha256, bytes=size)

    def LoadState(self, request: pb.LoadRequest, context):
        job = self._connected(request.job_id, context)
        self._use_device()
        try:
            steps = job.load_state(list(request.paths))
        except (OSError, ValueError, KeyError) as err:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"rank {job.rank} cannot load the checkpoint: {err}")
        return pb.LoadReply(optimizer_steps=steps)

    def Teardown(self, request: pb.JobRef, context):
        self._use_device()
        with self._lock:
            job = self._job
            if job is not None and job.job_id == request.job_id:
                self._check_owner(job.job_id, self._owner, context)
                self._job = None
        if job is not None and job.job_id == request.job_id:
            job.close()
            _collect()
        return pb.Empty()

    def adopt(self, coordinator: str) -> None:
        """This server registered with the coordinator of incarnation `coordinator`: only
        it sets jobs up here from now on, and a job another incarnation set up has no one
        left to drive it or tear it down."""
        with self._lock:  # taken and let go at once: a Setup of the new one's may follow
            self._registered = coordinator
            job, owner = self._job, self._owner
            if job is None or owner == coordinator:
                return
            self._job = None
        self._let_go(job, f"it belongs to coordinator incarnation {owner or '(none)'!r}, and this server is now "
                          f"registered with incarnation {coordinator!r}")

    def drop_job(self, reason: str) -> None:
        """Closes the job this server holds, if any, as Teardown would, when no one is
        left to tear it down: its coordinator is gone or forgot us, or the server stops.
        A step running in a handler stops at its next action."""
        with self._lock:
            job, self._job = self._job, None
        self._let_go(job, reason)

    def _let_go(self, job: StageJob | None, reason: str) -> None:
        if job is not None:
            log.warning("dropping job %s: %s", job.job_id, reason)
            self._use_device()
            job.close()
            _collect()


def _evaluation_report(evaluation, reports_loss: bool) -> pb.EvalReport:
    """A rank's part of an evaluation: the ranks that report the loss report its loss."""
    if not reports_loss or evaluation.loss is None:
        return pb.EvalReport(seconds=evaluation.seconds)
    return pb.EvalReport(loss=evaluation.loss, tokens=evaluation.tokens, seconds=evaluation.seconds)


def _collect() -> None:
    """Frees a closed job's memory now: its executor holds itself in a reference cycle
    (its table of bound handlers), which only the cyclic collector frees, and that may
    not run for a long time on an idle server. Called where the job lets go and where a
    step that was running lets go, whichever comes last."""
    gc.collect()
