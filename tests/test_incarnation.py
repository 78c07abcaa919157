"""A stage server takes a Setup only from the coordinator incarnation it is registered
with, a job's control calls only from the incarnation that set it up, and lets a job go
when it registers with another (common/incarnation.py): a real stage-server gRPC
service on loopback, its job set up and stepped for real."""

from __future__ import annotations

import datetime

import grpc
import pytest
import torch.distributed as dist

from interleaf.coordinator.config import load_config
from interleaf.coordinator.plan import ServerSlot, plan_job, setup_requests
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.incarnation import AttachIncarnation
from interleaf.stageserver.service import StageServerService

CONFIG = ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.seq_len=8", "model.vocab_size=256",
          "parallel.dp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
          "parallel.microbatches=2", "train.global_batch=4", "train.steps=2"]
OLD, NEW = "0123456789abcdef", "fedcba9876543210"


@pytest.fixture
def server():
    service = StageServerService("127.0.0.1")
    server = wire.server(threads=4)
    rpc.add_StageServerServicer_to_server(service, server)
    address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    channels = {who: wire.channel(address) for who in (OLD, NEW, "")}
    stubs = {who: rpc.StageServerStub(grpc.intercept_channel(c, AttachIncarnation(who)) if who else c)
             for who, c in channels.items()}
    yield service, stubs, store
    for channel in channels.values():
        channel.close()
    server.stop(grace=None)


def _setup(stub, store, job_id: str) -> None:
    config = load_config("", CONFIG)
    plan = plan_job(config, [ServerSlot("s0", "127.0.0.1:1", "127.0.0.1")])
    (request,) = setup_requests(job_id, config, plan, ("127.0.0.1", store.port, job_id), 20)
    stub.Setup(request, timeout=30)


def _refused(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_only_the_incarnation_that_set_a_job_up_controls_it(server):
    service, stubs, store = server
    service.adopt(OLD)
    _setup(stubs[OLD], store, "owned")
    for who in (NEW, ""):
        for call in (lambda: stubs[who].Connect(pb.ConnectRequest(job_id="owned"), timeout=10),
                     lambda: list(stubs[who].RunSteps(pb.RunStepsRequest(job_id="owned", num_steps=1), timeout=10)),
                     lambda: stubs[who].Teardown(pb.JobRef(job_id="owned"), timeout=10)):
            err = _refused(call)
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert f"job 'owned' on this server belongs to coordinator incarnation {OLD!r}" in err.details()
            assert f"this call comes from incarnation {who or '(none)'!r}" in err.details()
        # Nor may it set up a job of its own, nor take this one over: the server is
        # registered with OLD.
        for job_id in ("owned", "another"):
            err = _refused(lambda: _setup(stubs[who], store, job_id))
            assert err.code() == grpc.StatusCode.PERMISSION_DENIED
            assert err.details().startswith(f"this server is registered with coordinator incarnation {OLD!r}; "
                                            f"a Setup from incarnation {who or '(none)'!r} is refused")
    # The owner itself sets up no second job beside the first.
    err = _refused(lambda: _setup(stubs[OLD], store, "another"))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details() == f"server is busy with job owned of coordinator incarnation {OLD!r}"
    # The owner's calls go through, untouched by the refusals.
    stubs[OLD].Connect(pb.ConnectRequest(job_id="owned"), timeout=30)
    (report,) = stubs[OLD].RunSteps(pb.RunStepsRequest(job_id="owned", num_steps=1), timeout=60)
    assert report.step == 0 and report.loss > 0
    stubs[OLD].Teardown(pb.JobRef(job_id="owned"), timeout=30)


def test_registering_with_another_incarnation_drops_the_stale_job(server):
    service, stubs, store = server
    service.adopt(OLD)
    _setup(stubs[OLD], store, "stale")
    service.adopt(OLD)  # registered again with its own coordinator: kept
    stubs[OLD].Connect(pb.ConnectRequest(job_id="stale"), timeout=30)
    service.adopt(NEW)  # a newer coordinator's registration reply
    err = _refused(lambda: list(stubs[OLD].RunSteps(pb.RunStepsRequest(job_id="stale", num_steps=1), timeout=10)))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    # An idle server takes no job from the incarnation it left.
    err = _refused(lambda: _setup(stubs[OLD], store, "late"))
    assert err.code() == grpc.StatusCode.PERMISSION_DENIED
    assert err.details() == (f"this server is registered with coordinator incarnation {NEW!r}; a Setup from "
                             f"incarnation {OLD!r} is refused: only the coordinator it is registered with sets "
                             f"jobs up on it")
    # Free for the new coordinator's next job.
    _setup(stubs[NEW], store, "fresh")
    stubs[NEW].Connect(pb.ConnectRequest(job_id="fresh"), timeout=30)
    (report,) = stubs[NEW].RunSteps(pb.RunStepsRequest(job_id="fresh", num_steps=1), timeout=60)
    assert report.step == 0
    stubs[NEW].Teardown(pb.JobRef(job_id="fresh"), timeout=30)
