"""Runs a peer (the torch baseline a benchmark compares Interleaf with) on N spawned
processes joined by a default gloo process group, the way a torch user would launch it.

Each process gets one torch thread, as each Interleaf stage server does (`--threads 1`),
so a ratio compares the systems and not how many cores each side happened to use.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_peers(fn, world_size: int, *args) -> list:
    """Calls fn(rank, *args) on `world_size` processes that share a default gloo group;
    returns their return values in rank order. A rank that raises fails the call (and
    torch.multiprocessing terminates the others)."""
    with tempfile.TemporaryDirectory(prefix="interleaf-bench-") as tmp:
        results = mp.get_context("spawn").SimpleQueue()
        mp.spawn(
            _peer,
            args=(world_size, os.path.join(tmp, "store"), results, fn, args),
            nprocs=world_size,
            join=True,
        )
        # Results are a few hundred floats per rank: well under the pipe's buffer, so a
        # child never blocks on put() while the parent is still joining.
        by_rank = dict(results.get() for _ in range(world_size))
    return [by_rank[rank] for rank in range(world_size)]


def _peer(rank: int, world_size: int, store_path: str, results, fn, args) -> None:
    torch.set_num_threads(1)
    # The stage servers bind gloo to 127.0.0.1; the peer's tensors take the same loopback.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        results.put((rank, fn(rank, *args)))
    finally:
        dist.destroy_process_group()
