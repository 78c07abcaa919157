"""Fuzzing both services over real gRPC (issue 10, "Security"): malformed and
out-of-range job specs at SubmitJob, random bytes and well-typed messages with random
field values at every RPC of the coordinator and of the stage servers. Each call is
answered with a clean status (never UNKNOWN or INTERNAL, never a traceback); afterwards
no server holds anything and the same servers run a real job to its end.

A cluster of its own (a coordinator and 2 stage servers): the fuzz registers servers
that never heartbeat, which the shared cluster's other tests must not see.
Hypothesis runs derandomized with no example database, so every run is the same.
"""

from __future__ import annotations

import json
import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.coordinator.plan import ServerSlot, plan_job, setup_requests
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.incarnation import AttachIncarnation
from tests.conftest import TINY

FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
CLEAN = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DATA_LOSS, grpc.StatusCode.UNIMPLEMENTED}
"""What a well-behaved server may answer bad input with. UNKNOWN is a handler that raised;
INTERNAL, a request gRPC could not parse or a bug; UNAVAILABLE, a server gone."""
FUZZ_JOB = "fuzz-job"
TIMEOUT_S = 30


@pytest.fixture(scope="module")
def fuzz_cluster(tmp_path_factory):
    with LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path_factory.mktemp("fuzz-logs"))) as running:
        client = running.client()
        real = {s.address for s in client.servers()}
        # The stage servers take Setups only from the coordinator they registered with: the
        # fuzz speaks to them as that incarnation, learnt as any registering server learns it.
        coordinator = wire.channel(running.address, running.security)
        owner = rpc.CoordinatorStub(coordinator).RegisterServer(
            pb.RegisterRequest(address="127.0.0.1:9", host="fuzz", device="cpu"), timeout=TIMEOUT_S).incarnation
        channels = {running.address: coordinator}
        channels.update({a: grpc.intercept_channel(wire.channel(a, running.security), AttachIncarnation(owner))
                         for a in sorted(real)})
        yield running, client, real, channels
        for channel in channels.values():
            channel.close()
        client.close()


def answered_cleanly(call, what: str):
    """The call's reply, or None when it was refused with a clean status and one short line."""
    try:
        return call()
    except grpc.RpcError as err:
        code, details = err.code(), err.details() or ""
        assert code in CLEAN, f"{what}: {code} {details}"
        assert "Traceback" not in details and len(details) < 4096 and "\n" not in details, f"{what}: {details!r}"
        return None


def _raw(channel, service: str, method) -> callable:
    """A callable sending `bytes` as the request (identity serializers) and returning bytes."""
    path = f"/interleaf.{service}/{method.name}"
    make = {(False, False): channel.unary_unary, (False, True): channel.unary_stream,
            (True, False): channel.stream_unary, (True, True): channel.stream_stream}
    call = make[(method.client_streaming, method.server_streaming)](path)
    if method.client_streaming:
        return lambda payload: call(iter([payload, payload[::-1]]), timeout=TIMEOUT_S)
    if method.server_streaming:
        return lambda payload: list(call(payload, timeout=TIMEOUT_S))
    return lambda payload: call(payload, timeout=TIMEOUT_S)


SERVICES = {name: list(pb.DESCRIPTOR.services_by_name[name].methods) for name in ("Coordinator", "StageServer")}

# ---------------------------------------------------------------- job specs

SECTIONS = {"model": ["n_layers", "d_model", "n_heads", "seq_len", "vocab_size"],
            "parallel": ["dp", "tp", "pp", "vpp", "schedule", "microbatches", "zero", "zero_prefetch", "transport"],
            "train": ["steps", "global_batch", "lr", "warmup_steps", "weight_decay", "grad_clip", "seed",
                      "precision", "recompute", "betas", "eps", "lr_decay", "min_lr_ratio", "decay_fraction",
                      "recompute_layers"],
            "data": ["source"], "checkpoint": ["dir", "every", "keep", "resume"],
            "recovery": ["max_restarts", "progress_timeout_s"]}
names = st.one_of(st.sampled_from(sorted({k for keys in SECTIONS.values() for k in keys})),
                  st.text(min_size=1, max_size=300))
values = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70),
    st.sampled_from([0, -1, 10**9, 10**12, 2**32, 2**64, 1e12, 1e300]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.text(max_size=100),
    st.text(min_size=4097, max_size=5000),
    st.lists(st.integers(), max_size=3),
)


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, (int, list)):
        return json.dumps(value)
    return json.dumps(value)  # a TOML basic string, as far as JSON's escapes go


specs = st.dictionaries(st.one_of(st.sampled_from(sorted(SECTIONS)), st.text(max_size=20)),
                        st.dictionaries(names, values, max_size=4), max_size=4)


def _toml(spec: dict) -> str:
    return "".join(f"[{json.dumps(section)}]\n" + "".join(f"{json.dumps(key)} = {_toml_value(value)}\n"
                                                          for key, value in table.items())
                   for section, table in spec.items())


@FUZZ
@given(spec=specs, overrides=st.lists(st.one_of(
    st.text(max_size=80),
    st.builds(lambda s, k, v: f"{s}.{k}={v}", st.sampled_from(sorted(SECTIONS)), names, values)), max_size=4),
    garbage=st.one_of(st.none(), st.text(max_size=200)))
def test_submit_job_answers_malformed_specs_cleanly(fuzz_cluster, spec, overrides, garbage):
    cluster, client, _, _ = fuzz_cluster
    text = _toml(spec) if garbage is None else garbage
    reply = answered_cleanly(lambda: client.submit(text, overrides), f"SubmitJob {text!r} {overrides!r}")
    if reply is not None:  # a valid job after all: it runs on the cluster; stop it
        _stop(client, reply.job_id)


@FUZZ
@given(method=st.sampled_from([("Coordinator", m) for m in SERVICES["Coordinator"]]
                              + [("StageServer", m) for m in SERVICES["StageServer"]]),
       payload=st.one_of(st.binary(max_size=300),
                         # a string field (1) holding bytes that are not UTF-8
                         st.binary(min_size=1, max_size=100).map(lambda b: b"\x0a" + bytes([len(b) + 1]) + b"\xff" + b)),
       server=st.integers(min_value=0, max_value=1))
def test_random_bytes_at_every_rpc_are_answered_cleanly(fuzz_cluster, method, payload, server):
    cluster, client, real, channels = fuzz_cluster
    service, descriptor = method
    address = cluster.address if service == "Coordinator" else sorted(real)[server]
    call = _raw(channels[address], service, descriptor)
    reply = answered_cleanly(lambda: call(payload), f"{service}.{descriptor.name} {payload!r}")
    if descriptor.name == "SubmitJob" and reply is not None:
        job_id = pb.JobStatus.FromString(reply).job_id
        _stop(client, job_id)
    if service == "StageServer" and descriptor.name == "Setup" and reply is not None:
        _teardown_anything(channels, real, pb.SetupRequest.FromString(payload).job_id)


def test_malformed_utf8_is_invalid_argument(fuzz_cluster):
    """A config that is not UTF-8 never reaches the handler: INVALID_ARGUMENT naming the
    method and message, not gRPC's INTERNAL "Exception deserializing request"."""
    cluster, _, _, channels = fuzz_cluster
    submit = _raw(channels[cluster.address], "Coordinator", pb.DESCRIPTOR.services_by_name["Coordinator"]
                  .methods_by_name["SubmitJob"])
    with pytest.raises(grpc.RpcError) as caught:
        submit(b"\x0a\x03\xff\xfe\xfd")
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("/interleaf.Coordinator/SubmitJob: 5 request bytes are not a "
                                             "interleaf.SubmitJobRequest message")


# ---------------------------------------------------------------- well-typed, random values

u32 = st.one_of(st.integers(min_value=0, max_value=2**32 - 1), st.sampled_from([0, 1, 2, 3, 4, 2**31, 2**32 - 1]))
floats = st.floats(allow_nan=True, allow_infinity=True)
texts = st.one_of(st.text(max_size=40), st.sampled_from(["", FUZZ_JOB, "builtin", "../../etc/passwd", "a\0b"]),
                  st.text(min_size=5000, max_size=6000))
coordinates = st.builds(pb.Coordinates, dp=u32, pp=u32, tp=u32)
setup_requests_random = st.builds(
    pb.SetupRequest, job_id=texts, rank=u32, world_size=u32, coordinates=coordinates, grid=coordinates, vpp=u32,
    model=st.builds(pb.ModelSpec, n_layers=u32, d_model=u32, n_heads=u32, seq_len=u32, vocab_size=u32),
    train=st.builds(pb.TrainSpec, steps=u32, global_batch=u32, lr=floats, warmup_steps=u32, weight_decay=floats,
                    grad_clip=floats, seed=st.integers(min_value=0, max_value=2**64 - 1), microbatches=u32,
                    precision=st.sampled_from(["", "fp32", "fp16", "x"]), recompute=texts, beta1=floats,
                    beta2=floats, eps=floats, lr_decay=texts, min_lr_ratio=floats, decay_fraction=floats,
                    recompute_layers=u32),
    data_source=texts,
    chunks=st.lists(st.builds(pb.ChunkSpec, index=u32, first_layer=u32, end_layer=u32), max_size=3),
    program=st.lists(st.builds(pb.Action, text=st.one_of(texts, st.sampled_from(["F0.0", "B0.0", "OPT"]))),
                     max_size=4),
    groups=st.lists(st.builds(pb.Group, name=texts, members=st.lists(u32, max_size=3)), max_size=3),
    store_host=texts, store_port=u32, store_prefix=texts, comm_timeout_s=floats, zero=u32, transport=texts,
)
job_refs = st.builds(pb.JobRef, job_id=texts)
stage_calls = st.one_of(
    setup_requests_random.map(lambda r: ("Setup", r)),
    st.builds(pb.ConnectRequest, job_id=st.text(max_size=20),
              group_ids=st.lists(st.builds(pb.GroupId, name=texts, id=st.binary(max_size=200)), max_size=3))
    .map(lambda r: ("Connect", r)),
    st.builds(pb.RunStepsRequest, job_id=texts, first_step=u32, num_steps=u32).map(lambda r: ("RunSteps", r)),
    st.builds(pb.SaveRequest, job_id=texts, path=texts, background=st.booleans()).map(lambda r: ("SaveState", r)),
    st.builds(pb.LoadRequest, job_id=texts, paths=st.lists(texts, max_size=3)).map(lambda r: ("LoadState", r)),
    job_refs.map(lambda r: ("FinishSaves", r)),
    st.builds(pb.FileRef, job_id=texts, path=texts, sha256=texts).map(lambda r: ("ReadFile", r)),
    st.lists(st.builds(pb.FileChunk, job_id=texts, path=texts, sha256=texts, data=st.binary(max_size=100)),
             min_size=0, max_size=3).map(lambda r: ("WriteFile", r)),
    job_refs.map(lambda r: ("Teardown", r)),
)


def _stage_call(channel, name: str, request):
    method = getattr(rpc.StageServerStub(channel), name)
    if name == "WriteFile":
        return lambda: method(iter(request), timeout=TIMEOUT_S)
    if name in ("RunSteps", "ReadFile"):
        return lambda: list(method(request, timeout=TIMEOUT_S))
    return lambda: method(request, timeout=TIMEOUT_S)


def _set_up_unconnected(channel):
    """A valid one-rank job set up on a server (not connected): the calls that need a
    model, the spool's file calls and a second Setup meet a job there."""
    config = load_config("", TINY + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"])
    plan = plan_job(config, [ServerSlot("s0", "127.0.0.1:1", "127.0.0.1")])
    request = setup_requests(FUZZ_JOB, config, plan, ("127.0.0.1", 1, FUZZ_JOB), 10.0)[0]
    _stage_call(channel, "Setup", request)()


@FUZZ
@given(call=stage_calls, server=st.integers(min_value=0, max_value=1), with_job=st.booleans())
def test_well_typed_random_stage_server_calls_are_answered_cleanly(fuzz_cluster, call, server, with_job):
    cluster, client, real, channels = fuzz_cluster
    name, request = call
    channel = channels[sorted(real)[server]]
    if with_job:
        _set_up_unconnected(channel)
        # Aim at the job that is there; Connect aside, which would wait for its store
        # (never started) until its timeout and rightly answer UNAVAILABLE.
        if name == "WriteFile" and request:
            request[0].job_id = FUZZ_JOB
        elif name not in ("Setup", "Connect", "WriteFile"):
            request.job_id = FUZZ_JOB
    try:
        reply = answered_cleanly(_stage_call(channel, name, request), f"{name} {request!r:.300}")
    finally:
        _teardown_anything(channels, real, FUZZ_JOB)
    if name == "Setup" and reply is not None:
        _teardown_anything(channels, real, request.job_id)


coordinator_calls = st.one_of(
    st.builds(pb.RegisterRequest, address=texts, host=texts, device=texts,
              memory_bytes=st.integers(min_value=0, max_value=2**64 - 1)).map(lambda r: ("RegisterServer", r)),
    st.builds(pb.HeartbeatRequest, server_id=texts).map(lambda r: ("Heartbeat", r)),
    job_refs.map(lambda r: ("GetJob", r)),
    job_refs.map(lambda r: ("WatchJob", r)),
    job_refs.map(lambda r: ("CancelJob", r)),
    st.builds(pb.SubmitJobRequest, config_toml=texts, overrides=st.lists(texts, max_size=3))
    .map(lambda r: ("SubmitJob", r)),
)


@FUZZ
@given(call=coordinator_calls)
def test_well_typed_random_coordinator_calls_are_answered_cleanly(fuzz_cluster, call):
    cluster, client, _, channels = fuzz_cluster
    name, request = call
    method = getattr(rpc.CoordinatorStub(channels[cluster.address]), name)
    run = (lambda: list(method(request, timeout=TIMEOUT_S))) if name == "WatchJob" else \
        (lambda: method(request, timeout=TIMEOUT_S))
    reply = answered_cleanly(run, f"{name} {request!r:.300}")
    if name == "SubmitJob" and reply is not None:
        _stop(client, reply.job_id)


# ---------------------------------------------------------------- sizes

def test_oversized_requests_are_refused_by_size(fuzz_cluster):
    cluster, client, real, channels = fuzz_cluster
    config = "# " + "x" * wire.MAX_CONFIG_BYTES + "\n"
    with pytest.raises(grpc.RpcError) as caught:
        client.submit(config)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (f"config_toml of {len(config)} bytes must be at most "
                                      f"{wire.MAX_CONFIG_BYTES} bytes")
    with pytest.raises(grpc.RpcError) as caught:  # beyond what the coordinator receives at all
        client.submit("x" * (wire.COORDINATOR_RECEIVE_BYTES + 1))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    setup = _stage_call(channels[sorted(real)[0]], "Setup",
                        pb.SetupRequest(job_id=FUZZ_JOB, data_source="x" * wire.STAGE_SERVER_RECEIVE_BYTES))
    with pytest.raises(grpc.RpcError) as caught:
        setup()
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


# ---------------------------------------------------------------- afterwards

def test_after_the_fuzz_no_server_holds_anything_and_a_real_job_runs(fuzz_cluster):
    cluster, client, real, channels = fuzz_cluster
    # Registrations the fuzz made (addresses no server listens at) stop heartbeating at
    # once: wait until they are DEAD, so that the job below is placed on real servers.
    deadline = time.monotonic() + 15
    while any(s.address not in real and s.state != "DEAD" for s in client.servers()):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    servers = client.servers()
    assert {s.address: s.state for s in servers if s.address in real} == dict.fromkeys(real, "IDLE")
    assert all(s.state == "DEAD" for s in servers if s.address not in real)
    for address in real:  # and the servers themselves hold no job
        with pytest.raises(grpc.RpcError) as caught:
            _stage_call(channels[address], "RunSteps", pb.RunStepsRequest(job_id=FUZZ_JOB, num_steps=1))()
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    status = client.submit("", TINY + ["parallel.pp=2", "parallel.vpp=1", "train.steps=2"])
    final, steps = client.wait(status.job_id, timeout_s=120)
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in steps] == [0, 1]
    assert all(s.state == "IDLE" for s in client.servers() if s.address in real)


def _stop(client, job_id: str, timeout_s: float = 120) -> None:
    """Cancels a job the fuzz started (a spec that was valid after all) once it runs, as
    a user would, and waits for its end: a cancel is prompt between steps, while one
    during setup waits for the servers' rendezvous."""
    started = time.monotonic()
    deadline = started + timeout_s
    while (state := client.status(job_id).state) == "SETTING_UP" or \
            (state == "PENDING" and time.monotonic() < started + 3):  # waiting for more servers than there are
        assert time.monotonic() < deadline, f"job {job_id} did not start"
        time.sleep(0.05)
    client.cancel(job_id)
    while client.status(job_id).state not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, f"job {job_id} did not end"
        time.sleep(0.05)


def _teardown_anything(channels, real, job_id: str) -> None:
    for address in real:
        try:
            _stage_call(channels[address], "Teardown", pb.JobRef(job_id=job_id))()
        except grpc.RpcError as err:  # a job of another owner: not the fuzz's
            assert err.code() in CLEAN, err
