"""The peers' processes: N spawned processes in one default gloo process group, the way
a torch user launches training, kept alive across the runs of a benchmark as its
LocalCluster is (so neither side pays process start-up between runs, and each torch run
follows its Interleaf run closely).

Each process gets one torch thread, as each Interleaf stage server does (`--threads 1`),
so a ratio compares the systems and not how many cores each side happened to use.
"""

from __future__ import annotations

import datetime
import os
import queue
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 300.0
"""Bounds each gloo collective, so a rank whose partner failed gives up instead of
waiting forever, and how long a run may take."""


class PeerWorld:
    def __init__(self, size: int):
        self.size = size
        self._context = mp.get_context("spawn")
        self._tmp = tempfile.TemporaryDirectory(prefix="interleaf-bench-")
        self._tasks = [self._context.SimpleQueue() for _ in range(size)]
        self._results = self._context.Queue()
        self._processes = []

    def start(self) -> "PeerWorld":
        """Starts the processes and returns once every one has joined the group, so
        that their start-up (importing torch, connecting gloo) never overlaps a
        measured run."""
        store = os.path.join(self._tmp.name, "store")
        for rank in range(self.size):
            process = self._context.Process(
                target=_serve, args=(rank, self.size, store, self._tasks[rank], self._results), daemon=True
            )
            process.start()
            self._processes.append(process)
        self._collect("start")
        return self

    def run(self, fn, *args) -> list:
        """Calls fn(rank, *args) on every rank (fn at module level, picklable) and returns
        the values in rank order. A rank that raises or dies fails the call; close() then
        stops the others, which may be stuck in a collective with it."""
        for tasks in self._tasks:
            tasks.put((fn, args))
        return self._collect(getattr(fn, "__qualname__", str(fn)))

    def _collect(self, what: str) -> list:
        values = {}
        deadline = time.monotonic() + TIMEOUT_S
        while len(values) < self.size:
            try:
                rank, ok, value = self._results.get(timeout=1.0)
            except queue.Empty:
                # A rank that failed put its traceback first, so it was read above;
                # one that died without a word (killed, crashed) is found here.
                dead = [r for r, p in enumerate(self._processes) if not p.is_alive() and r not in values]
                if dead:
                    raise RuntimeError(f"peer {what}: ranks {dead} exited without answering") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"peer {what}: no answer in {TIMEOUT_S:.0f}s") from None
                continue
            if not ok:
                raise RuntimeError(f"peer {what} failed on rank {rank}:\n{value}")
            values[rank] = value
        return [values[rank] for rank in range(self.size)]

    def close(self) -> None:
        for process, tasks in zip(self._processes, self._tasks):
            if process.is_alive():
                tasks.put(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join()
        self._processes.clear()
        self._tmp.cleanup()

    def __enter__(self) -> "PeerWorld":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(rank: int, size: int, store_path: str, tasks, results) -> None:
    torch.set_num_threads(1)
    # The stage servers bind gloo to 127.0.0.1; the peers' tensors take the same loopback.
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, size), rank=rank, world_size=size,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    results.put((rank, True, "ready"))
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, True, fn(rank, *args)))
            except Exception:
                results.put((rank, False, traceback.format_exc()))
                return
    finally:
        dist.destroy_process_group()
