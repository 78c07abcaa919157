"""Several jobs on one coordinator: each takes only the servers it needs, and a job that
needs more than are idle waits in PENDING until they are released."""

from __future__ import annotations

import time

from tests.conftest import SERVERS, TINY

FOUR = TINY + ["parallel.pp=4", "parallel.vpp=1", "parallel.schedule=1f1b", "train.steps=40"]
EIGHT = TINY + ["parallel.dp=2", "parallel.pp=4", "parallel.vpp=1", "parallel.schedule=1f1b"]


def test_jobs_share_servers_and_a_large_one_waits(client):
    first = client.submit("", FOUR).job_id
    second = client.submit("", FOUR).job_id
    # Both small jobs hold all 8 servers between them once set up.
    deadline = time.monotonic() + 120
    while not all(client.status(j).state == "RUNNING" for j in (first, second)):
        assert time.monotonic() < deadline, [client.status(j).state for j in (first, second)]
        time.sleep(0.1)
    large = client.submit("", EIGHT).job_id
    assert client.status(large).state == "PENDING"

    results = {j: client.wait(j, timeout_s=300)[0] for j in (first, second, large)}
    assert all(r.state == "SUCCEEDED" for r in results.values()), [r.error for r in results.values()]
    used = [{r.server_address for r in results[j].ranks} for j in (first, second)]
    assert len(used[0]) == len(used[1]) == 4 and not used[0] & used[1]
    assert len({r.server_address for r in results[large].ranks}) == SERVERS
    assert all(s.state == "IDLE" for s in client.servers())
