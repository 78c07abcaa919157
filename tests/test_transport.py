"""GlooTransport's verbs on real 2- and 3-rank gloo groups, and SoloTransport.

Each world size spawns its processes once: every rank runs all the verbs in one function
and returns what it saw; the tests compare that with the expected values computed here.
Inputs are small integers (in float32, bfloat16 and float64 alike), so sums are exact
and comparisons are equality.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist
from tests.gloo_world import run_world

from interleaf.stageserver.transport import SoloTransport, connect_gloo

TAGS = (0, 1, 5, 9)
ROOT = {2: 1, 3: 2}  # a non-zero broadcast root for each world size
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
SHARD = 5
"""Elements per rank in the flat-buffer collectives (a ZeRO bucket's shard)."""


def _message(src: int, tag: int) -> torch.Tensor:
    """What `src` sends with `tag`: its shape and values identify both."""
    return torch.arange(tag + 2, dtype=torch.float32) + 100 * src + 10 * tag


def _reduce_input(rank: int, size: int) -> torch.Tensor:
    return (torch.arange(size * 2 * 3, dtype=torch.float32) * (rank + 1)).view(size * 2, 3)


def _flat_input(rank: int, size: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat buffer of size*SHARD elements, different on every rank; the sums stay below
    256, so bfloat16 holds them exactly."""
    return ((torch.arange(size * SHARD) % 7) * (rank + 1) + rank).to(dtype)


def _shard(rank: int, dtype: torch.dtype) -> torch.Tensor:
    return (torch.arange(SHARD) * 3 - rank).to(dtype)


def _flat_collectives(rank: int, t, size: int) -> dict:
    """ZeRO's collectives on flat buffers, asynchronous as the buckets issue them: a
    reduce-scatter whose output is 1/size of its input, and an all-gather of shards."""
    out = {}
    for dtype in DTYPES:
        source = _flat_input(rank, size, dtype)
        scattered = torch.full((SHARD,), -1.0, dtype=dtype)
        gathered = torch.full((size * SHARD,), -1.0, dtype=dtype)
        reduce_work = t.reduce_scatter(scattered, source, async_op=True)
        gather_work = t.all_gather(gathered, _shard(rank, dtype), async_op=True)
        reduce_work.wait()
        gather_work.wait()
        out[dtype] = {"source": source, "reduce_scatter": scattered, "all_gather": gathered}
    try:  # a full-size output would be an all-reduce in disguise: refused
        t.reduce_scatter(torch.zeros(size * SHARD), _flat_input(rank, size, torch.float32))
        out["full_size_output"] = "accepted"
    except ValueError:
        out["full_size_output"] = "refused"
    return out


def _verbs(rank: int, t, size: int) -> dict:
    """Every verb once, in the same order on every rank."""
    out = {"rank": t.rank, "size": t.size, "name": t.name}

    # Ring: send to the right with tags in increasing order, post the receives from the
    # left in decreasing order, and only then wait; matching must go by tag.
    right, left = (rank + 1) % size, (rank - 1) % size
    sends = [t.send(_message(rank, tag), right, tag) for tag in TAGS]
    received = {tag: torch.zeros(tag + 2) for tag in TAGS}
    recvs = [t.recv(received[tag], left, tag) for tag in reversed(TAGS)]
    for work in recvs + sends:
        work.wait()
    out["ring"] = received

    # A send the network has taken says so without being waited (the executor reaps its
    # sends by asking, and frees what they held): every receive has landed once the
    # barrier is passed, so every send has completed.
    sent = t.send(_message(rank, 0), right, 0)
    landed = torch.zeros(2)
    t.recv(landed, left, 0).wait()
    t.all_reduce(torch.zeros(1))
    deadline = time.monotonic() + 10
    while not sent.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    out["send_completed_unwaited"] = sent.is_completed()
    sent.wait()

    x = torch.arange(6, dtype=torch.float32) + 10 * rank
    assert t.all_reduce(x) is None
    out["all_reduce"] = x

    y = torch.arange(6, dtype=torch.float32) * (rank + 1)
    work = t.all_reduce(y, async_op=True)
    work.wait()
    out["all_reduce_async"] = y

    gathered = torch.full((size * 2, 3), -1.0)
    t.all_gather(gathered, torch.full((2, 3), float(rank)) + torch.arange(3))
    out["all_gather"] = gathered

    scattered = torch.full((2, 3), -1.0)
    source = _reduce_input(rank, size)
    t.reduce_scatter(scattered, source)
    out["reduce_scatter"] = scattered
    out["reduce_scatter_input"] = source  # must be left as it was

    b = torch.arange(4, dtype=torch.float32) * 7 if rank == ROOT[size] else torch.zeros(4)
    t.broadcast(b, ROOT[size])
    out["broadcast"] = b

    out["flat"] = _flat_collectives(rank, t, size)  # last: it ends with a refused call
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def world(request) -> tuple[int, list[dict]]:
    size = request.param
    return size, run_world(_verbs, size, size, group="verbs")


def test_group_identity(world):
    size, results = world
    assert [(r["rank"], r["size"], r["name"]) for r in results] == [(i, size, "verbs") for i in range(size)]


def test_tagged_send_recv_matches_by_tag_across_a_ring(world):
    size, results = world
    for rank, r in enumerate(results):
        left = (rank - 1) % size
        for tag in TAGS:
            assert torch.equal(r["ring"][tag], _message(left, tag)), (rank, tag)


def test_a_taken_send_is_completed_without_being_waited(world):
    _, results = world
    assert [r["send_completed_unwaited"] for r in results] == [True] * len(results)


def test_all_reduce_sums(world):
    size, results = world
    expected = sum(torch.arange(6, dtype=torch.float32) + 10 * r for r in range(size))
    expected_async = torch.arange(6, dtype=torch.float32) * sum(r + 1 for r in range(size))
    for r in results:
        assert torch.equal(r["all_reduce"], expected)
        assert torch.equal(r["all_reduce_async"], expected_async)


def test_all_gather_concatenates_in_rank_order(world):
    size, results = world
    expected = torch.cat([torch.full((2, 3), float(r)) + torch.arange(3) for r in range(size)])
    for r in results:
        assert torch.equal(r["all_gather"], expected)


def test_reduce_scatter_gives_rank_r_the_rth_slice_of_the_sum(world):
    size, results = world
    total = sum(_reduce_input(r, size) for r in range(size))
    for rank, r in enumerate(results):
        assert torch.equal(r["reduce_scatter"], total[2 * rank : 2 * rank + 2])
        assert torch.equal(r["reduce_scatter_input"], _reduce_input(rank, size))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_async_reduce_scatter_keeps_1_over_size_of_the_sum(world, dtype):
    size, results = world
    total = sum(_flat_input(r, size, torch.float64) for r in range(size))
    assert total.max() < 256
    for rank, r in enumerate(results):
        flat = r["flat"][dtype]
        scattered = flat["reduce_scatter"]
        assert scattered.dtype == dtype
        assert scattered.numel() * size == flat["source"].numel()
        assert torch.equal(scattered, total[rank * SHARD:(rank + 1) * SHARD].to(dtype))
        assert torch.equal(flat["source"], _flat_input(rank, size, dtype))  # input untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_async_all_gather_concatenates_shards(world, dtype):
    size, results = world
    expected = torch.cat([_shard(r, dtype) for r in range(size)])
    for r in results:
        gathered = r["flat"][dtype]["all_gather"]
        assert gathered.dtype == dtype
        assert torch.equal(gathered, expected)


def test_reduce_scatter_refuses_a_full_size_output(world):
    _, results = world
    assert [r["flat"]["full_size_output"] for r in results] == ["refused"] * len(results)


def test_broadcast_from_a_non_zero_root(world):
    size, results = world
    for r in results:
        assert torch.equal(r["broadcast"], torch.arange(4, dtype=torch.float32) * 7)


# --- SoloTransport -------------------------------------------------------------------------


def test_solo_collectives_are_identities():
    t = SoloTransport("tp/d0/p1")
    assert (t.rank, t.size, t.name) == (0, 1, "tp/d0/p1")
    x = torch.tensor([1.5, -2.0, 3.0])

    y = x.clone()
    assert t.all_reduce(y) is None
    assert torch.equal(y, x)
    work = t.all_reduce(y, async_op=True)
    assert work.wait() is None
    assert torch.equal(y, x)

    out = torch.zeros(3)
    t.all_gather(out, x)
    assert torch.equal(out, x)
    out = torch.zeros(3)
    t.reduce_scatter(out, x)
    assert torch.equal(out, x)

    y = x.clone()
    t.broadcast(y, 0)
    assert torch.equal(y, x)
    t.close()


def test_solo_send_and_recv_raise_naming_the_group():
    t = SoloTransport("pp/d1/t0")
    with pytest.raises(RuntimeError, match="group pp/d1/t0 has one member: nothing to send to 1"):
        t.send(torch.zeros(2), 1, 0)
    with pytest.raises(RuntimeError, match="group pp/d1/t0 has one member: nothing to receive from 1"):
        t.recv(torch.zeros(2), 1, 0)


def test_connect_gloo_gives_a_group_of_one_a_solo_transport():
    # A one-member group never touches the store: no process group is built.
    t = connect_gloo(None, "dp/p0/t3", [6], 6, timeout_s=1.0)
    assert isinstance(t, SoloTransport)
    assert t.name == "dp/p0/t3"


def test_closing_a_group_fails_every_send_not_done():
    """Two ranks of one real gloo group in this process (a thread each to join it). Gloo's
    sends wait for their receiver, so none of rank 0's completes before rank 1 receives.
    A receiver that dies without receiving does not end that wait either (a stage server
    waited out its whole exit bound so), so closing lets every sender go, the one the
    reaper is waiting for included."""
    store = dist.HashStore()
    ranks = [None, None]

    def join(rank):
        ranks[rank] = connect_gloo(store, "closing", [0, 1], rank, timeout_s=30.0, hostname="127.0.0.1")

    joining = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in joining:
        thread.start()
    for thread in joining:
        thread.join()
    sender, receiver = ranks
    first = sender.send(torch.ones(8), 1, 1)  # the reaper waits for this one
    second = sender.send(torch.ones(8), 1, 2)  # queued behind it
    time.sleep(0.2)
    assert not first.is_completed() and not second.is_completed()
    sender.close()
    # Both failed at once, rather than at the group's timeout.
    assert _completed_within(first, 5) and _completed_within(second, 5)
    for send in (first, second):
        with pytest.raises(RuntimeError, match="group closing was closed before this send was taken"):
            send.wait()
    with pytest.raises(RuntimeError, match="group closing was closed"):
        sender.send(torch.ones(8), 1, 3).wait()  # a step still running: no new thread
    # Gloo still holds the one taken up: a late receiver gets it, and the reaper ends.
    landed = torch.zeros(8)
    receiver.recv(landed, 0, 1).wait()
    assert torch.equal(landed, torch.ones(8))
    deadline = time.monotonic() + 10
    while any(t.name == "gloo-sends-closing" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.name == "gloo-sends-closing"]
    receiver.close()


def _completed_within(work, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    return work.is_completed()
