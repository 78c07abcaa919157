"""The communication watchdog (stageserver/transport/watchdog.py) over real gloo work:
a receive that no peer ever sends to is aborted after the timeout, and the overrun is
raised, naming the group and the operation; work that completes never trips it.

NCCL has no timeout of its own, which is why the watchdog exists; gloo's works answer
`is_completed()` the same way, so the logic is tested here without a GPU
(bench/gpu/check_nccl.py runs it over a real NCCL communicator)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from tests.gloo_world import run_world

from interleaf.stageserver.transport import connect_gloo
from interleaf.stageserver.transport.watchdog import Overrun, Watchdog

TIMEOUT_S = 0.5
GLOO_TIMEOUT_S = 3.0
"""gloo's abort does not interrupt a receive already posted: it fails at gloo's own
timeout. NCCL's abort ends the kernel at once, which is what the watchdog is for."""


def _matched(rank: int, t) -> dict:
    aborted = []
    dog = Watchdog("pp", TIMEOUT_S, lambda: aborted.append(1), poll_s=0.02)
    tensor = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    work = t.send(tensor, 1, tag=3) if rank == 0 else t.recv(tensor, 0, tag=3)
    dog.watch(work, "p2p")
    work.wait()
    time.sleep(3 * TIMEOUT_S)
    dog.check()
    dog.close()
    return {"aborts": len(aborted), "tensor": tensor}


def _pair() -> list:
    """A real two-rank gloo group, both ranks in this process (one thread joins each):
    the never-matched receive must not leave a peer process to tear down."""
    store = dist.HashStore()
    pair = [None, None]

    def join(rank):
        pair[rank] = connect_gloo(store, "pp", [0, 1], rank, timeout_s=GLOO_TIMEOUT_S, hostname="127.0.0.1")
    threads = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return pair


def test_a_receive_nobody_sends_to_is_aborted_after_the_timeout_and_named():
    sender, receiver = _pair()  # the sender never sends
    aborted = []

    def abort():
        aborted.append(time.monotonic())
        receiver.abort()

    dog = Watchdog("pp", TIMEOUT_S, abort, poll_s=0.02)
    start = time.monotonic()
    work = dog.watch(receiver.recv(torch.zeros(4), 0, tag=3), "recv<0 tag 3")
    while dog.failure is None and time.monotonic() - start < 10:
        time.sleep(0.01)
    detected = time.monotonic() - start
    with pytest.raises(Overrun, match=r"group pp: recv<0 tag 3 did not finish within 0.5 s; the group was aborted"):
        dog.check()
    with pytest.raises(RuntimeError):
        work.wait()  # the aborted receive ends (here at gloo's own timeout)
    dog.close()
    sender.abort()
    assert TIMEOUT_S <= detected < TIMEOUT_S + 1.0
    assert len(aborted) == 1


def test_work_that_completes_never_trips_the_watchdog():
    sender, receiver = run_world(_matched, 2, group="pp")
    assert sender["aborts"] == receiver["aborts"] == 0
    assert torch.equal(receiver["tensor"], torch.arange(4.0))


class _QueuedWork:
    """A GPU operation's two events as the watchdog sees them, driven by the test: it
    starts when the work queued ahead of it on its stream is done, then finishes."""

    def __init__(self):
        self.started, self.completed = threading.Event(), threading.Event()

    def is_started(self) -> bool:
        return self.started.is_set()

    def is_completed(self) -> bool:
        return self.completed.is_set()


def test_an_operation_is_timed_from_when_it_starts_not_from_when_it_was_queued():
    aborted = []
    dog = Watchdog("dp", TIMEOUT_S, lambda: aborted.append(1), poll_s=0.02)
    work = dog.watch(_QueuedWork(), "all_reduce")
    time.sleep(3 * TIMEOUT_S)  # queued behind a step's compute for longer than the timeout
    dog.check()
    assert aborted == []
    work.started.set()
    time.sleep(TIMEOUT_S / 2)
    work.completed.set()  # finished within its time once started
    time.sleep(3 * TIMEOUT_S)
    dog.check()
    late = dog.watch(_QueuedWork(), "reduce_scatter")
    late.started.set()
    time.sleep(TIMEOUT_S + 0.3)
    with pytest.raises(Overrun, match="group dp: reduce_scatter did not finish within 0.5 s"):
        dog.check()
    dog.close()
    assert aborted == [1]
