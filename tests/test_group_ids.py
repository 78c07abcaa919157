"""Group ids made by each group's member 0 during Setup and relayed by the coordinator
in Connect (stageserver/transport/groups.py): real stage-server gRPC services on
loopback, a real TCPStore, real gloo groups.

NCCL needs this relay (its communicators rendezvous on ncclGetUniqueId's bytes, made
by one member); gloo takes the same path, the id naming the group's keys in the store,
so these tests exercise on a CPU what a GPU job relies on."""

from __future__ import annotations

import datetime
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch.distributed as dist

from interleaf.coordinator.config import load_config
from interleaf.coordinator.plan import ServerSlot, plan_job, setup_requests
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.stageserver.service import StageServerService

CONFIG = ["model.n_layers=2", "model.d_model=16", "model.n_heads=2", "model.seq_len=8", "model.vocab_size=256",
          "parallel.dp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
          "parallel.microbatches=2", "train.global_batch=4", "train.steps=1"]


def serve_in_process(services: list[StageServerService]):
    """Real gRPC stage servers on loopback, in this process: (servers, stubs)."""
    running, stubs = [], []
    for service in services:
        server = wire.server(threads=4)
        rpc.add_StageServerServicer_to_server(service, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        running.append(server)
        stubs.append(rpc.StageServerStub(wire.channel(f"127.0.0.1:{port}")))
    return running, stubs


@pytest.fixture(scope="module")
def servers():
    running, stubs = serve_in_process([StageServerService("127.0.0.1") for _ in range(2)])
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    yield stubs, store
    for server in running:
        server.stop(grace=None)


def _setup(stubs, store, job_id: str, comm_timeout_s: float):
    config = load_config("", CONFIG)
    plan = plan_job(config, [ServerSlot(f"s{i}", f"127.0.0.1:{i}", "127.0.0.1") for i in range(2)])
    requests = setup_requests(job_id, config, plan, ("127.0.0.1", store.port, job_id), comm_timeout_s)
    replies = [stub.Setup(request, timeout=30) for stub, request in zip(stubs, requests)]
    return requests, replies


def _connect(stubs, job_id: str, ids_per_rank: list[dict]):
    def connect(rank):
        ids = [pb.GroupId(name=n, id=i) for n, i in ids_per_rank[rank].items()]
        try:
            stubs[rank].Connect(pb.ConnectRequest(job_id=job_id, group_ids=ids), timeout=30)
            return "connected"
        except grpc.RpcError as err:
            return f"{err.code().name}: {err.details()}"
    with ThreadPoolExecutor(2) as pool:
        return list(pool.map(connect, range(2)))


def _teardown(stubs, job_id: str):
    for stub in stubs:
        stub.Teardown(pb.JobRef(job_id=job_id), timeout=30)


def test_member_zero_makes_each_group_id_and_the_relayed_ids_join_the_groups(servers):
    stubs, store = servers
    requests, replies = _setup(stubs, store, "relay-1", comm_timeout_s=20)
    shared = sorted(g.name for g in requests[0].groups if len(g.members) > 1)
    assert shared == ["dp/p0/t0", "world"]
    # Rank 0 is member 0 of both shared groups: it alone made their ids, one per group.
    assert sorted(g.name for g in replies[0].group_ids) == shared
    assert list(replies[1].group_ids) == []
    assert len({g.id for g in replies[0].group_ids}) == 2
    assert all(len(g.id) == 16 for g in replies[0].group_ids)
    assert replies[0].device == replies[1].device == "cpu"
    relayed = {g.name: g.id for g in replies[0].group_ids}
    assert _connect(stubs, "relay-1", [relayed, relayed]) == ["connected", "connected"]
    _teardown(stubs, "relay-1")


def test_ranks_given_different_ids_do_not_form_a_group(servers):
    stubs, store = servers
    requests, replies = _setup(stubs, store, "relay-2", comm_timeout_s=2)
    relayed = {g.name: g.id for g in replies[0].group_ids}
    stale = {name: bytes(16) for name in relayed}  # what a rank of an earlier attempt would hold
    outcome = _connect(stubs, "relay-2", [relayed, stale])
    assert all(o.startswith("UNAVAILABLE: rank") and "could not connect" in o for o in outcome), outcome
    _teardown(stubs, "relay-2")


def test_a_group_with_no_relayed_id_is_refused_by_name(servers):
    stubs, store = servers
    _setup(stubs, store, "relay-3", comm_timeout_s=2)
    outcome = _connect(stubs, "relay-3", [{}, {}])
    assert all("no id was relayed for it" in o for o in outcome), outcome
    _teardown(stubs, "relay-3")
