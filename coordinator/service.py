"""The coordinator's gRPC handlers: parse, check, answer. Jobs run in their drivers."""

from __future__ import annotations

import logging
import threading
import time

import grpc

from interleaf.common import wire
from interleaf.common.data.vocab_check import check_eval_source, check_vocab
from interleaf.common.limits import shown
from interleaf.common.model.compile_modes import device_type_of
from interleaf.coordinator.admission import check_fits, needed_bytes
from interleaf.coordinator.checkpoints import CheckpointError, find
from interleaf.coordinator.config import load_config
from interleaf.coordinator.driver import JobDriver
from interleaf.coordinator.job_store import JobStore
from interleaf.coordinator.jobs import JobTable
from interleaf.coordinator.plan import plan_eval_programs, plan_programs
from interleaf.coordinator.registry import HEARTBEAT_INTERVAL_S, Registry
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc

log = logging.getLogger("interleaf.coordinator")

SERVER_THREADS = 64
MAX_WATCHERS = SERVER_THREADS // 2
"""Each WatchJob stream holds one of the server's threads for its job's life; beyond
this many the next is refused, so heartbeats and every other call always find a thread."""
MAX_NAME_CHARS = 256
"""RegisterServer: the longest address and host accepted (a DNS name is at most 253)."""
MAX_DEVICE_CHARS = 64


class CoordinatorService(rpc.CoordinatorServicer):
    def __init__(self, store_address: tuple[str, int], steps_per_call: int = 8, job_store: JobStore | None = None,
                 incarnation: str = ""):
        self.watchers = threading.BoundedSemaphore(MAX_WATCHERS)
        self.steps_per_call = steps_per_call
        self.registry = Registry()
        self.jobs = JobTable(job_store)
        self.jobs.on_pruned(self._forget_drivers)
        self.incarnation = incarnation  # this process's: the servers bind their jobs to it
        self.drivers: dict[str, JobDriver] = {}
        self.store_address = store_address

    def close_job_logs(self) -> None:
        """The coordinator is stopping: every job's TensorBoard files (metrics.
        tensorboard_dir) are closed, as its drivers' daemon threads end without a word."""
        for driver in list(self.drivers.values()):
            driver.job.close_listeners()

    def _forget_drivers(self, job_ids: list[str]) -> None:
        """Pruned jobs (--keep-jobs) are long finished: their drivers only hold memory."""
        for job_id in job_ids:
            self.drivers.pop(job_id, None)

    def RegisterServer(self, request: pb.RegisterRequest, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address='' must be host:port")
        refused = _registration_refused(request)
        if refused:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        server_id = self.registry.register(request.address, request.host, request.device, request.memory_bytes,
                                           request.metrics_port, request.peak_flops)
        return pb.RegisterReply(server_id=server_id, heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
                                incarnation=self.incarnation)

    def Heartbeat(self, request: pb.HeartbeatRequest, context):
        if not self.registry.heartbeat(request.server_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown server {shown(request.server_id)}: register again")
        return pb.Empty()

    def ListServers(self, request, context):
        return pb.ServerList(
            servers=[
                pb.ServerInfo(server_id=e.server_id, address=e.address, host=e.host,
                              device=e.device, state=e.state, job_id=e.job_id,
                              memory_bytes=e.memory_bytes, metrics_port=e.metrics_port, peak_flops=e.peak_flops,
                              heartbeat_age_s=e.heartbeat_age,
                              heartbeat_gap_max_s=e.heartbeat_gap_max)
                for e in self.registry.servers()
            ]
        )

    def SubmitJob(self, request: pb.SubmitJobRequest, context):
        refused = _submission_refused(request)
        if refused:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, refused)
        try:
            config = load_config(request.config_toml, list(request.overrides))
            if config.parallel.plan:
                raise ValueError("parallel.plan='auto' is planned before submitting (`interleaf run --plan auto`, "
                                 "`interleaf submit` or `interleaf plan`): submit the layout it chose")
            check_vocab(config.model.vocab_size, config.data.source, config.data.tokenizer, tokenizer_needed=False)
            if config.eval.enabled:
                check_eval_source(config.model.vocab_size, config.eval.source, config.data.source)
            self._admit(config)
            plan_eval_programs(config)  # an evaluation that cannot be lowered is refused now, not mid-job
        except ValueError as err:  # ConfigError, VocabError, AdmissionError; a plan that cannot be built
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        overrides = list(request.overrides)
        if config.checkpoint.init:
            # Stored as resolved now (a folder, or one step's manifest, absolute): a
            # restarted coordinator must not take a newer step of a checkpoint.dir, or
            # read a relative path from another working folder.
            overrides.append(f"checkpoint.init={config.checkpoint.init}")
        record = self.jobs.create(config, request.config_toml, overrides)
        driver = JobDriver(record, self.registry, self.store_address, self.steps_per_call)
        self.drivers[record.job_id] = driver
        driver.start()
        return record.status()

    def resume_jobs(self) -> None:
        """After a restart: every job the job store holds unfinished runs again through
        the recovery path, from its newest checkpoint, once enough servers have
        registered (again). One without a checkpoint starts over from step 0, as
        Megatron-LM and torchtitan do when told to load and none exists: the data order
        and learning rate are functions of the step, so the result is still the
        uninterrupted run's, and failing it would only make its user submit it again.
        One whose cancel was asked for (stored before CancelJob answered) ends CANCELLED.
        Needs no server running: called before the gRPC server starts, so that every
        unfinished job has its driver before any call can name it."""
        detected, started = time.time(), time.perf_counter()
        for record in self.jobs.unfinished():
            if record.final:  # its config no longer loads
                continue
            if record.cancel_requested.is_set():  # the coordinator died before the job stopped
                record.set_state("CANCELLED", reason="cancelled before the coordinator stopped; recorded after "
                                                     "the restart")
                continue
            if _trained_to_the_end(record):  # only its final state was not recorded
                record.set_state("SUCCEEDED", reason="its last checkpoint was complete when the coordinator "
                                                     "stopped; recorded after the restart")
                continue
            was = f"{record.state} at step {record.step}"
            where = f"its checkpoint {record.checkpoint}" if record.checkpoint else "step 0 (it has no checkpoint)"
            record.set_state("RECOVERING", reason=f"coordinator restarted (the job was {was}): resuming from {where}")
            log.warning("job %s: resuming after the coordinator restarted, from %s", record.job_id, where)
            driver = JobDriver(record, self.registry, self.store_address, self.steps_per_call)
            driver.resume_after_restart(detected, started)
            self.drivers[record.job_id] = driver
            driver.start()

    def _admit(self, config) -> None:
        """Refuses a job the registered servers cannot hold (AdmissionError). With too
        few servers registered yet, the job waits and the driver places it on servers
        with memory enough."""
        servers = [e for e in self.registry.servers() if e.alive]
        if len(servers) >= config.parallel.world_size:
            programs, _ = plan_programs(config)
            device_type = device_type_of([e.device for e in servers])
            check_fits(needed_bytes(config, programs, device_type), [(e.address, e.memory_bytes) for e in servers])

    def _job(self, job_id: str, context):
        record = self.jobs.get(job_id)
        if record is None:
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"no job {shown(job_id)}: never submitted to this coordinator, or finished and removed "
                          f"(it keeps the newest {self.jobs.store.keep_jobs} finished jobs, --keep-jobs)")
        return record

    def GetJob(self, request: pb.JobRef, context):
        return self._job(request.job_id, context).status()

    def WatchJob(self, request: pb.JobRef, context):
        record = self._job(request.job_id, context)
        if not self.watchers.acquire(blocking=False):
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{MAX_WATCHERS} watchers already follow jobs on this coordinator (the most it serves "
                          f"at once): poll GetJob, or watch later")
        try:
            yield from record.follow(alive=context.is_active)
        finally:
            self.watchers.release()

    def CancelJob(self, request: pb.JobRef, context):
        record = self._job(request.job_id, context)
        if not record.final:
            driver = self.drivers.get(record.job_id)
            if driver is not None:
                driver.cancel()
            else:  # its driver is still being made (SubmitJob): it sees the request when it starts
                record.request_cancel()
        return record.status()

    def GetTrace(self, request: pb.TraceRequest, context):
        record = self._job(request.job_id, context)
        step = request.step if request.HasField("step") else None
        trace = record.traces.get(step)
        if trace is None:
            traced = record.traces.steps()
            wanted = sorted(record.config.trace.resolved(record.config.train.steps))
            context.abort(grpc.StatusCode.NOT_FOUND,
                          f"job {request.job_id} has no trace of {'any step' if step is None else f'step {step}'} "
                          f"(traced so far: {traced or 'none'}; trace.steps asks for steps {wanted})")
        if request.HasField("profile_rank"):  # one rank's profiles, each its own reply
            profile = record.traces.profile(trace.step, request.profile_rank)
            if profile is None:
                context.abort(grpc.StatusCode.NOT_FOUND,
                              f"job {request.job_id}'s trace of step {trace.step} keeps no profile of rank "
                              f"{request.profile_rank} (profiled ranks: {list(trace.profiled_ranks) or 'none'})")
            return profile
        return trace


def _registration_refused(request: pb.RegisterRequest) -> str:
    """Why a registration is refused ('' if it is not): names the field, value and rule."""
    for name, value, most in (("address", request.address, MAX_NAME_CHARS), ("host", request.host, MAX_NAME_CHARS),
                              ("device", request.device, MAX_DEVICE_CHARS)):
        if len(value) > most:
            return f"{name}={shown(value)} must be at most {most} characters"
    host, _, port = request.address.rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"address={shown(request.address)} must be HOST:PORT with a port from 1 to 65535"
    return ""


def _submission_refused(request: pb.SubmitJobRequest) -> str:
    """Why a submission is refused for its size alone ('' if it is not)."""
    sizes = (("config_toml", len(request.config_toml.encode())),
             ("overrides", sum(len(o.encode()) for o in request.overrides)))
    for name, size in sizes:
        if size > wire.MAX_CONFIG_BYTES:
            return f"{name} of {size} bytes must be at most {wire.MAX_CONFIG_BYTES} bytes"
    return ""


def _trained_to_the_end(record) -> bool:
    try:
        return bool(record.checkpoint) and find(record.checkpoint).step >= record.config.train.steps
    except (CheckpointError, OSError):  # gone or damaged: the resume names what is wrong
        return False
