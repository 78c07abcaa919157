"""The Python client for a coordinator."""

from __future__ import annotations

from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.security import Security

RPC_TIMEOUT_S = 30.0


class Client:
    def __init__(self, address: str, security: Security | None = None):
        """`security`: the token and TLS files to call with (default: this process's,
        which unless configured is $INTERLEAF_TOKEN's token, without TLS)."""
        self.address = address
        self._channel = wire.channel(address, security)
        self._stub = rpc.CoordinatorStub(self._channel)

    def submit(self, config_toml: str = "", overrides: list[str] = ()) -> pb.JobStatus:
        request = pb.SubmitJobRequest(config_toml=config_toml, overrides=list(overrides))
        return self._stub.SubmitJob(request, timeout=RPC_TIMEOUT_S)

    def status(self, job_id: str) -> pb.JobStatus:
        return self._stub.GetJob(pb.JobRef(job_id=job_id), timeout=RPC_TIMEOUT_S)

    def cancel(self, job_id: str) -> pb.JobStatus:
        return self._stub.CancelJob(pb.JobRef(job_id=job_id), timeout=RPC_TIMEOUT_S)

    def trace(self, job_id: str, step: int | None = None) -> pb.StepTrace:
        """A traced step's executed timeline (None: the newest traced step)."""
        request = pb.TraceRequest(job_id=job_id) if step is None else pb.TraceRequest(job_id=job_id, step=step)
        return self._stub.GetTrace(request, timeout=RPC_TIMEOUT_S)

    def trace_profile(self, job_id: str, step: int, rank: int) -> pb.StepReport:
        """One rank's report of a traced step with its torch profile and memory snapshot,
        which `trace` leaves out (its profiled_ranks names the ranks that have them)."""
        request = pb.TraceRequest(job_id=job_id, step=step, profile_rank=rank)
        return self._stub.GetTrace(request, timeout=RPC_TIMEOUT_S).reports[0]

    def servers(self) -> list[pb.ServerInfo]:
        return list(self._stub.ListServers(pb.Empty(), timeout=RPC_TIMEOUT_S).servers)

    def peak_flops(self, status: pb.JobStatus) -> list[float]:
        """The peak FLOP/s of the servers a job's ranks run on (0: unknown), by rank."""
        by_address = {s.address: s.peak_flops for s in self.servers()}
        return [by_address.get(r.server_address, 0.0) for r in status.ranks]

    def watch(self, job_id: str, timeout_s: float | None = None):
        """Yields JobEvents (step events and state changes) until the job ends."""
        return self._stub.WatchJob(pb.JobRef(job_id=job_id), timeout=timeout_s)

    def wait(self, job_id: str, timeout_s: float | None = None) -> tuple[pb.JobStatus, list[pb.StepEvent]]:
        """Follows a job to its end; returns its final status and every step event."""
        steps = []
        for event in self.watch(job_id, timeout_s):
            if event.HasField("step"):
                steps.append(event.step)
        return self.status(job_id), steps

    def close(self) -> None:
        self._channel.close()
