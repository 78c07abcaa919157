"""Runs a function on N local processes joined by a real gloo group, so tests can compare
a distributed computation with its single-process reference on CPU."""

from __future__ import annotations

import datetime
import pickle
import queue
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from interleaf.stageserver.transport import connect_gloo

TIMEOUT_S = 60.0
"""Bounds rendezvous, every collective, and (with slack for spawning) the whole run."""


def run_world(fn, world_size: int, *args, group: str = "tp") -> list:
    """Calls fn(rank, transport, *args) on `world_size` spawned processes, where
    `transport` is the gloo group `group` made of all of them, and returns their return
    values in rank order.

    `fn` must be defined at module level (the children import it by name) and its
    arguments and return value picklable. If any rank raises or dies, the calling test
    fails with that rank's traceback and the other ranks are terminated.
    """
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_child,
            args=(fn, rank, world_size, store.port, group, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    try:
        return _collect(procs, results)
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join()


def _collect(procs: list, results) -> list:
    deadline = time.monotonic() + 2 * TIMEOUT_S
    values = {}
    while len(values) < len(procs):
        try:
            rank, ok, payload = results.get(timeout=0.5)
        except queue.Empty:
            # A clean exit has already flushed its result into the queue, so only a
            # non-zero exit code means a rank died without reporting (e.g. a crash).
            for rank, proc in enumerate(procs):
                if rank not in values and proc.exitcode not in (None, 0):
                    _fail_all(procs, f"rank {rank} died with exit code {proc.exitcode}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(values))
                _fail_all(procs, f"ranks {missing} did not finish within {2 * TIMEOUT_S}s")
            continue
        if not ok:
            _fail_all(procs, f"rank {rank} raised:\n{payload}")
        values[rank] = pickle.loads(payload)
    return [values[rank] for rank in range(len(procs))]


def _fail_all(procs: list, message: str) -> None:
    # The surviving ranks are likely blocked in a collective with the failed one.
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    pytest.fail(message, pytrace=False)


def _child(fn, rank: int, world_size: int, port: int, group: str, args: tuple, results):
    # The ranks share the machine's cores; one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore(
            "127.0.0.1", port, is_master=False,
            timeout=datetime.timedelta(seconds=TIMEOUT_S),
        )
        members = list(range(world_size))
        transport = connect_gloo(store, group, members, rank, TIMEOUT_S, "127.0.0.1")
        value = fn(rank, transport, *args)
        # Nobody shuts the group down while a peer may still be finishing its last
        # collective: wait until every rank has returned from fn.
        store.set(f"{group}/done/{rank}", b"1")
        store.wait([f"{group}/done/{r}" for r in members])
        transport.close()
        # Plain pickle copies tensors by value; the queue's own pickler would pass them
        # as shared memory that dies with this process.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
