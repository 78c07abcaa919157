"""The coordinator's gRPC handlers: parse, check, answer. Jobs run in their drivers."""

from __future__ import annotations

import threading

import grpc

from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.driver import JobDriver
from interleaf.coordinator.admission import check_fits, needed_bytes
from interleaf.coordinator.jobs import JobTable
from interleaf.coordinator.plan import plan_programs
from interleaf.coordinator.registry import HEARTBEAT_INTERVAL_S, Registry
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc


SERVER_THREADS = 64
MAX_WATCHERS = SERVER_THREADS // 2
"""Each WatchJob stream holds one of the server's threads for its job's life; beyond
this many the next is refused, so heartbeats and every other call always find a thread."""


class CoordinatorService(rpc.CoordinatorServicer):
    def __init__(self, store_address: tuple[str, int], steps_per_call: int = 8):
        self.watchers = threading.BoundedSemaphore(MAX_WATCHERS)
        self.steps_per_call = steps_per_call
        self.registry = Registry()
        self.jobs = JobTable()
        self.drivers: dict[str, JobDriver] = {}
        self.store_address = store_address

    def RegisterServer(self, request: pb.RegisterRequest, context):
        if not request.address:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address='' must be host:port")
        server_id = self.registry.register(request.address, request.host, request.device, request.memory_bytes)
        return pb.RegisterReply(server_id=server_id, heartbeat_interval_s=HEARTBEAT_INTERVAL_S)

    def Heartbeat(self, request: pb.HeartbeatRequest, context):
        if not self.registry.heartbeat(request.server_id):
            context.abort(grpc.StatusCode.NOT_FOUND, f"unknown server {request.server_id!r}: register again")
        return pb.Empty()

    def ListServers(self, request, context):
        return pb.ServerList(
            servers=[
                pb.ServerInfo(server_id=e.server_id, address=e.address, host=e.host,
                              device=e.device, state=e.state, job_id=e.job_id,
                              memory_bytes=e.memory_bytes)
                for e in self.registry.servers()
            ]
        )

    def SubmitJob(self, request: pb.SubmitJobRequest, context):
        try:
            config = load_config(request.config_toml, list(request.overrides))
            self._admit(config)
        except ConfigError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        record = self.jobs.create(config)
        driver = JobDriver(record, self.registry, self.store_address, self.steps_per_call)
        self.drivers[record.job_id] = driver
        driver.start()
        return record.status()

    def _admit(self, config) -> None:
        """Refuses a job the registered servers cannot hold (AdmissionError). With too
        few servers registered yet, the job waits and the driver places it on servers
        with memory enough."""
        alive = [(e.address, e.memory_bytes) for e in self.registry.servers() if e.alive]
        if len(alive) >= config.parallel.world_size:
            programs, _ = plan_programs(config)
            check_fits(needed_bytes(config, programs), alive)

    def _job(self, job_id: str, context):
        record = self.jobs.get(job_id)
        if record is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no job {job_id!r}")
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
            self.drivers[record.job_id].cancel()
        return record.status()
