"""A stage server that dies mid-job, with recovery.max_restarts=0, fails the job with
the rank named; the survivors are torn down and freed, and the dead server is
forgotten (recovery itself: tests/test_recovery.py)."""

from __future__ import annotations

import re
import time

import grpc

from interleaf.clients.launcher import LocalCluster
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from tests.conftest import TINY


def test_killed_server_fails_the_job_and_frees_the_rest(tmp_path):
    with LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path)) as cluster:
        client = cluster.client()
        job = client.submit("", TINY + ["parallel.pp=2", "parallel.vpp=1", "train.steps=100000",
                                        "recovery.max_restarts=0"])
        events = client.watch(job.job_id, timeout_s=180)
        for event in events:
            if event.HasField("step") and event.step.step >= 2:
                break
        victim = cluster.processes[1]  # [0] is the coordinator
        dead = re.search(r"stage server on (\S+) ", (tmp_path / "stage-server-0.log").read_text())[1]
        victim.kill()
        victim.wait()
        for _ in events:
            pass
        final = client.status(job.job_id)
        assert final.state == "FAILED"
        # Either the dead rank's stream or a survivor's failed receive is reported first;
        # both name a rank and its server.
        assert final.error.startswith("rank "), final.error
        assert any(r.server_address in final.error for r in final.ranks), final.error

        survivors = [r.server_address for r in final.ranks if r.server_address != dead]
        stub = rpc.StageServerStub(wire.channel(survivors[0], cluster.security))
        try:
            list(stub.RunSteps(pb.RunStepsRequest(job_id=job.job_id, num_steps=1), timeout=10))
            raise AssertionError("the surviving server still holds the failed job")
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND
        deadline = time.monotonic() + 30
        while [(s.address == dead, s.state) for s in client.servers()] != [(False, "IDLE")]:
            assert time.monotonic() < deadline, [s.state for s in client.servers()]
            time.sleep(0.5)
        client.close()

