"""Both servers answer the standard gRPC health service (grpc.health.v1), as Kubernetes'
`grpc:` probes and `interleaf health` ask it: over real channels, with the shared token
required for everything but health Check."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common.health import COORDINATOR, STAGE_SERVER, check
from interleaf.common.security import TOKEN_ENV

TOKEN = "health-test-token"
SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "interleaf.clients.cli", *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, TOKEN_ENV: TOKEN})


def _until(status_of, want: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = status_of()
        except grpc.RpcError as err:
            last = err.code()
        if last == want:
            return
        time.sleep(0.1)
    raise AssertionError(f"wanted {want}, last answer {last}")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


@pytest.fixture
def processes():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:
        _stop(p)


def _watch(channel: grpc.Channel, service: str):
    """A health Watch stream, with the token (Watch is not exempt)."""
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Watch(health_pb2.HealthCheckRequest(service=service), timeout=60,
                      metadata=[("authorization", f"Bearer {TOKEN}")])


def test_health_without_token_and_readiness_follows_registration(processes, tmp_path):
    coordinator_port, stage_port = _free_port(), _free_port()
    coordinator_address, stage_address = f"127.0.0.1:{coordinator_port}", f"127.0.0.1:{stage_port}"
    db = str(tmp_path / "coordinator.db")  # the restarted coordinator takes over its predecessor's
    # The stage server first, its coordinator not there yet: alive, not ready.
    processes.append(_start("stage-server", "--coordinator", coordinator_address, "--host", "127.0.0.1",
                            "--port", str(stage_port), "--threads", "1"))
    stage = grpc.insecure_channel(stage_address)  # no token at all, as a Kubernetes probe
    _until(lambda: check(stage, ""), "SERVING")
    assert check(stage, STAGE_SERVER) == "NOT_SERVING"
    assert check(stage, "no.such.Service") == "SERVICE_UNKNOWN"

    processes.append(_start("coordinator", "--host", "127.0.0.1", "--port", str(coordinator_port),
                            "--http-port", "0", "--state-db", db))
    coordinator = grpc.insecure_channel(coordinator_address)
    _until(lambda: check(coordinator, COORDINATOR), "SERVING")
    assert check(coordinator, "") == "SERVING"
    _until(lambda: check(stage, STAGE_SERVER), "SERVING")  # registered

    # Only Check is let through without the token: the APIs and the health Watch stream are not.
    with pytest.raises(grpc.RpcError) as refused:
        rpc.CoordinatorStub(coordinator).ListServers(pb.Empty(), timeout=10)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(grpc.RpcError) as refused:
        next(health_pb2_grpc.HealthStub(stage).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # A wrong token on Check changes nothing: Check ignores the header.
    reply = health_pb2_grpc.HealthStub(stage).Check(health_pb2.HealthCheckRequest(service=STAGE_SERVER), timeout=10,
                                                    metadata=[("authorization", "Bearer wrong")])
    assert reply.status == SERVING

    # The coordinator replaced by a new one on the same address: the stage server is told
    # it is unknown, is NOT_SERVING until it has registered again, then SERVING.
    watch = _watch(stage, STAGE_SERVER)
    assert next(watch).status == SERVING
    _stop(processes.pop())
    processes.append(_start("coordinator", "--host", "127.0.0.1", "--port", str(coordinator_port),
                            "--http-port", "0", "--state-db", db))
    assert next(watch).status == NOT_SERVING
    assert next(watch).status == SERVING
    watch.cancel()

    # SIGTERM: both turn NOT_SERVING (a watcher sees it) before they stop.
    for channel, service, process in ((stage, STAGE_SERVER, processes[0]),
                                      (coordinator, COORDINATOR, processes[1])):
        watch = _watch(channel, service)
        assert next(watch).status == SERVING
        process.send_signal(signal.SIGTERM)
        assert next(watch).status == NOT_SERVING
        assert process.wait(timeout=10) in (0, 128 + signal.SIGTERM)


def test_health_command(processes, tmp_path):
    port = _free_port()
    address = f"127.0.0.1:{port}"
    down = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "health", address],
                          capture_output=True, text=True, timeout=60)
    assert down.returncode == 1 and "UNAVAILABLE" in down.stdout
    processes.append(_start("coordinator", "--host", "127.0.0.1", "--port", str(port), "--http-port", "0",
                            "--state-db", str(tmp_path / "coordinator.db")))
    # No token in its environment: Check needs none.
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    up = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "health", address, "--service", COORDINATOR,
                         "--wait", "60"], capture_output=True, text=True, timeout=90, env=env)
    assert up.returncode == 0, up.stdout + up.stderr
    assert up.stdout.strip() == f"{address} {COORDINATOR}: SERVING"
