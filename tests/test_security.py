"""Auth and TLS (common/security.py): every RPC of both services requires the shared
token, and TLS (mutual when asked) guards the wire, shown on real gRPC servers on
loopback (the services in this process) and on whole local clusters (a coordinator and
two stage servers as processes) running a job, with certificates made here."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

import grpc
import pytest

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.service import CoordinatorService
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.security import TOKEN_ENV, Security, SecurityError
from interleaf.stageserver.service import StageServerService
from tests.conftest import TINY
from tests.pki import make_pki

TOKEN = "the-shared-token-3f9c2a"
JOB = TINY + ["parallel.pp=1", "parallel.vpp=1", "parallel.dp=2"]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"), TOKEN)


# -- both services, in this process, on loopback ------------------------------------

def _serve(add_service, security: Security) -> tuple[grpc.Server, str]:
    server = wire.server(threads=4, security=security)
    add_service(server)
    port = wire.listen(server, "127.0.0.1:0", security)
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def coordinator():
    service = CoordinatorService(("127.0.0.1", 0))
    server, address = _serve(lambda s: rpc.add_CoordinatorServicer_to_server(service, s), Security(token=TOKEN))
    yield address
    server.stop(grace=None)


@pytest.fixture(scope="module")
def stage_server():
    service = StageServerService("127.0.0.1")
    server, address = _serve(lambda s: rpc.add_StageServerServicer_to_server(service, s), Security(token=TOKEN))
    yield address
    server.stop(grace=None)


def _coordinator_calls(stub):
    """One call of each kind; with the right token each gets its handler's own answer."""
    return {
        "RegisterServer": lambda: stub.RegisterServer(pb.RegisterRequest(address="10.9.9.9:1", host="intruder"),
                                                      timeout=5),
        "ListServers": lambda: stub.ListServers(pb.Empty(), timeout=5),
        "SubmitJob": lambda: stub.SubmitJob(pb.SubmitJobRequest(overrides=["model.n_layers=0"]), timeout=5),
        "WatchJob": lambda: list(stub.WatchJob(pb.JobRef(job_id="job-0"), timeout=5)),  # server streaming
    }


def _stage_server_calls(stub):
    return {
        "Setup": lambda: stub.Setup(pb.SetupRequest(job_id="j"), timeout=5),
        "RunSteps": lambda: list(stub.RunSteps(pb.RunStepsRequest(job_id="j", num_steps=1), timeout=5)),
        "WriteFile": lambda: stub.WriteFile(iter([pb.FileChunk(job_id="j", path="f", data=b"x")]), timeout=5),
        "Teardown": lambda: stub.Teardown(pb.JobRef(job_id="j"), timeout=5),
    }


def _outcome(call) -> tuple[str, str]:
    try:
        call()
    except grpc.RpcError as err:
        return err.code().name, err.details()
    return "OK", ""


# What each handler answers these requests itself: anything but UNAUTHENTICATED.
ANSWERED = {"RegisterServer": "OK", "ListServers": "OK", "SubmitJob": "INVALID_ARGUMENT", "WatchJob": "NOT_FOUND",
            "Setup": "INVALID_ARGUMENT", "RunSteps": "NOT_FOUND", "WriteFile": "NOT_FOUND", "Teardown": "OK"}


@pytest.mark.parametrize("service", ["coordinator", "stage server"])
def test_every_kind_of_call_needs_the_token(request, service):
    address = request.getfixturevalue("coordinator" if service == "coordinator" else "stage_server")
    stub_type, calls = ((rpc.CoordinatorStub, _coordinator_calls) if service == "coordinator"
                        else (rpc.StageServerStub, _stage_server_calls))
    for token, refusal in (("", "no token"), ("not-the-token", "wrong token")):
        channel = wire.channel(address, Security(token=token))
        for method, call in calls(stub_type(channel)).items():
            code, details = _outcome(call)
            assert code == "UNAUTHENTICATED", (method, token, code, details)
            assert details.startswith("/interleaf.") and f"/{method}: {refusal}" in details, details
        channel.close()
    channel = wire.channel(address, Security(token=TOKEN))
    for method, call in calls(stub_type(channel)).items():
        assert _outcome(call)[0] == ANSWERED[method], method  # the handler ran
    if service == "coordinator":  # the refused registrations left no trace; the accepted one did
        assert [s.host for s in rpc.CoordinatorStub(channel).ListServers(pb.Empty(), timeout=5).servers] == ["intruder"]
    channel.close()


def test_a_refused_request_is_never_parsed(stage_server):
    """Bytes that are no SetupRequest: refused for the token before anyone reads them,
    while the right token gets them parsed and found wanting: INVALID_ARGUMENT
    (common/malformed.py), not gRPC's own INTERNAL."""
    for token, want in (("wrong", grpc.StatusCode.UNAUTHENTICATED), (TOKEN, grpc.StatusCode.INVALID_ARGUMENT)):
        channel = wire.channel(stage_server, Security(token=token))
        setup = channel.unary_unary("/interleaf.StageServer/Setup")  # raw bytes both ways
        with pytest.raises(grpc.RpcError) as refused:
            setup(b"\xff\xff\xff not a protobuf", timeout=5)
        assert refused.value.code() == want, refused.value.details()
        channel.close()


def _tls_stage_server(pki, mutual: bool):
    security = Security(TOKEN, pki["server"], pki["server_key"], pki["ca"], pki["ca"] if mutual else "")
    return _serve(lambda s: rpc.add_StageServerServicer_to_server(StageServerService("127.0.0.1"), s), security)


def _teardown_with(address: str, security: Security) -> str:
    channel = wire.channel(address, security)
    try:
        return _outcome(lambda: rpc.StageServerStub(channel).Teardown(pb.JobRef(job_id="j"), timeout=5))[0]
    finally:
        channel.close()


def test_tls_server_talks_only_to_clients_that_trust_its_ca(pki):
    server, address = _tls_stage_server(pki, mutual=False)
    try:
        assert _teardown_with(address, Security(token=TOKEN, ca=pki["ca"])) == "OK"
        assert _teardown_with(address, Security(token=TOKEN)) == "UNAVAILABLE"  # plaintext
        assert _teardown_with(address, Security(token=TOKEN, ca=pki["stranger_ca"])) == "UNAVAILABLE"
        # TLS does not replace the token.
        assert _teardown_with(address, Security(token="wrong", ca=pki["ca"])) == "UNAUTHENTICATED"
    finally:
        server.stop(grace=None)


def test_mutual_tls_server_wants_a_client_certificate_its_ca_signed(pki):
    server, address = _tls_stage_server(pki, mutual=True)
    try:
        assert _teardown_with(address, Security(TOKEN, pki["client"], pki["client_key"], pki["ca"])) == "OK"
        assert _teardown_with(address, Security(token=TOKEN, ca=pki["ca"])) == "UNAVAILABLE"  # no certificate
        assert _teardown_with(address, Security(TOKEN, pki["intruder"], pki["intruder_key"], pki["ca"])) \
            == "UNAVAILABLE"
    finally:
        server.stop(grace=None)


def test_settings_that_cannot_work_are_refused_naming_the_flag(pki, tmp_path):
    with pytest.raises(SecurityError, match="--tls-cert and --tls-key go together"):
        Security(cert=pki["server"])
    with pytest.raises(SecurityError, match="--tls-client-ca needs --tls-cert"):
        Security(ca=pki["ca"], client_ca=pki["ca"])
    with pytest.raises(SecurityError, match="--tls-ca '/nonexistent.pem': No such file"):
        Security(ca="/nonexistent.pem")
    with pytest.raises(SecurityError, match="--tls-key .* holds no PEM private key"):
        Security(cert=pki["server"], key=pki["server"])
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SecurityError, match="is empty"):
        Security.from_options(token_file=str(empty))
    assert Security.from_options(environ={TOKEN_ENV: f" {TOKEN}\n"}).token == TOKEN
    assert Security.from_options(pki["token_file"], environ={TOKEN_ENV: "other"}).token == TOKEN
    result = _cli("servers", "--coordinator", "127.0.0.1:1", "--token-file", str(tmp_path / "absent"))
    assert result.returncode == 2 and result.stderr.startswith("error: --token-file"), result.stderr


# -- whole clusters, as processes ---------------------------------------------------

def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args], capture_output=True, text=True, timeout=60,
                          env={k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None})


def _cluster_security(pki, kind: str) -> Security:
    if kind == "token":
        return Security(token=TOKEN)
    return Security(TOKEN, pki["server"], pki["server_key"], pki["ca"], pki["ca"] if kind == "mutual TLS" else "")


@pytest.mark.parametrize("kind", ["token", "TLS", "mutual TLS"])
def test_a_guarded_cluster_runs_a_job_and_refuses_outsiders(pki, tmp_path, kind):
    with LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path), security=_cluster_security(pki, kind)) as cluster:
        # A third server, with another token, starts beside the job: it never joins.
        stranger = _stranger(cluster.address, tmp_path / "stranger.log") if kind == "token" else None
        try:
            _runs_and_refuses(cluster, pki, kind)
            if stranger is not None:
                _refused_registration(stranger, tmp_path / "stranger.log")
                client = cluster.client()
                assert len(client.servers()) == 2  # the cluster's own only
                client.close()
        finally:
            if stranger is not None:
                stranger.terminate()
                stranger.wait(timeout=30)


def _runs_and_refuses(cluster: LocalCluster, pki, kind: str) -> None:
    client = cluster.client()
    final, steps = client.wait(client.submit("", JOB).job_id, timeout_s=120)
    client.close()
    # The coordinator called both servers, and they it, with the token (and TLS).
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in steps] == [0, 1, 2]
    for process in cluster.processes:  # handed over by environment, never by command line
        proc = pathlib.Path(f"/proc/{process.pid}")
        assert TOKEN.encode() not in (proc / "cmdline").read_bytes()
        assert f"{TOKEN_ENV}={TOKEN}".encode() in (proc / "environ").read_bytes().split(b"\0")

    where = ["--coordinator", cluster.address]
    tls = [] if kind == "token" else ["--tls-ca", pki["ca"]]
    certificate = ["--tls-cert", pki["client"], "--tls-key", pki["client_key"]] if kind == "mutual TLS" else []
    mine = tls + certificate
    listed = _cli("servers", *where, "--token-file", pki["token_file"], *mine, env={TOKEN_ENV: None})
    assert listed.returncode == 0 and listed.stdout.count("IDLE") == 2, listed.stderr
    refusals = [
        ("no token", [*mine], None, "UNAUTHENTICATED: /interleaf.Coordinator/ListServers: no token"),
        ("wrong token", [*mine], "not-the-token", "UNAUTHENTICATED: /interleaf.Coordinator/ListServers: wrong token"),
    ]
    if kind != "token":
        refusals.append(("no CA", certificate, TOKEN, "UNAVAILABLE"))
    if kind == "mutual TLS":
        refusals.append(("no client certificate", tls, TOKEN, "UNAVAILABLE"))
    for what, flags, token, message in refusals:
        refused = _cli("servers", *where, *flags, env={TOKEN_ENV: token})
        last = refused.stderr.splitlines()[-1]  # gRPC may log a failed handshake first
        assert refused.returncode == 1 and last.startswith(f"error: {message}"), (what, refused.stderr)


def _stranger(coordinator: str, log: pathlib.Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "interleaf.clients.cli", "stage-server", "--coordinator", coordinator,
                             "--threads", "1", "--device", "cpu", "--memory-bytes", str(1 << 30)],
                            stderr=log.open("wb"), env={**os.environ, TOKEN_ENV: "not-the-token"},
                            start_new_session=True)


def _refused_registration(stranger: subprocess.Popen, log: pathlib.Path) -> None:
    deadline = time.monotonic() + 60
    while "the coordinator refuses this server's token" not in log.read_text():
        assert stranger.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
