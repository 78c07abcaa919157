"""The standard gRPC health service (grpc.health.v1.Health) on both servers, for
Kubernetes' `grpc:` probes, compose health checks and `interleaf health`.

Two names answer, so liveness and readiness can be told apart:

- `""` (the server as a whole): SERVING from the start until the process begins to
  stop; a liveness probe asks this one.
- the API's own name (`interleaf.Coordinator`, `interleaf.StageServer`): SERVING once
  the server can do its work (the coordinator: once listening; a stage server: once
  registered with its coordinator, and again NOT_SERVING while it has to register
  anew or its coordinator has been unreachable past the orphan timeout); a readiness
  probe asks this one.

On SIGTERM or SIGINT both turn NOT_SERVING for good before the server stops, so a
watcher sees the drain. `Check` is the one method that answers without the shared
token (see `security.UNGUARDED_METHODS`): Kubernetes' probes cannot send metadata.
"""

from __future__ import annotations

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
COORDINATOR = "interleaf.Coordinator"
STAGE_SERVER = "interleaf.StageServer"


class Health:
    """The health service of one gRPC server, for the API named `service`."""

    def __init__(self, server: grpc.Server, service: str):
        self.service = service
        self._servicer = health.HealthServicer()
        self._servicer.set(service, NOT_SERVING)
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)

    def ready(self) -> None:
        self._servicer.set(self.service, SERVING)

    def unready(self) -> None:
        self._servicer.set(self.service, NOT_SERVING)

    def stopping(self) -> None:
        """Every name NOT_SERVING, and no later `ready` changes that."""
        self._servicer.enter_graceful_shutdown()


def check(channel: grpc.Channel, service: str = "", timeout_s: float = 5.0) -> str:
    """The status `service` reports on the server behind `channel`: SERVING,
    NOT_SERVING or SERVICE_UNKNOWN (a name the server does not know)."""
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return "SERVICE_UNKNOWN"
        raise
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
