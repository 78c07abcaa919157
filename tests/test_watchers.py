"""Many watchers of a running job: beyond the coordinator's watcher limit the next is
refused with RESOURCE_EXHAUSTED, and heartbeats and other calls never wait for a thread
(issue 10: 80 watch streams used to make the coordinator answer nothing)."""

from __future__ import annotations

import threading
import time

import grpc

from interleaf.coordinator.service import MAX_WATCHERS
from tests.conftest import TINY


def test_watchers_beyond_the_limit_are_refused_and_the_coordinator_keeps_answering(cluster, client):
    status = client.submit("", TINY + ["train.steps=60", "parallel.pp=1", "parallel.vpp=1", "parallel.dp=2"])
    streams, refused, lock = [], [], threading.Lock()

    def watch():
        stream = client.watch(status.job_id, timeout_s=300)
        try:
            next(stream)  # the first event: the stream is being served
            with lock:
                streams.append(stream)
        except grpc.RpcError as err:
            with lock:
                refused.append(err)

    threads = [threading.Thread(target=watch) for _ in range(MAX_WATCHERS + 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    try:
        assert len(streams) == MAX_WATCHERS and len(refused) == 8
        assert {e.code() for e in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}
        assert "poll GetJob" in refused[0].details()
        # With every watcher slot taken, other calls still answer at once, and no
        # server misses its heartbeats.
        for _ in range(5):
            started = time.monotonic()
            client.status(status.job_id)
            states = [s.state for s in client.servers()]
            assert time.monotonic() - started < 1.0
            assert "DEAD" not in states, states
            time.sleep(0.2)
    finally:
        client.cancel(status.job_id)
        for stream in streams:
            stream.cancel()
    # Slots come back as streams end: a new watcher is served.
    deadline = time.monotonic() + 30
    while True:
        try:
            next(iter(client.watch(status.job_id, timeout_s=30)))
            break
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < deadline
            time.sleep(0.2)
