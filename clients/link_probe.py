"""Latency and bandwidth of gloo between two processes of this machine, as local stage
servers talk: a point-to-point message (half a round trip) and an all-reduce, each at
4 KiB, 256 KiB and 4 MiB, ten times, a line through each size's lower quartile
(fitting.fit_line: the device profile's law for pipeline messages (on CPU servers
only its bandwidth, the latency the profile's pipeline steps show taking the place of
the probe's: plan_profile.message_latency), and for the collectives the profile's jobs
could not measure on the servers: coordinator/planner/costs.py)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time

from interleaf.coordinator.planner.costs import Law
from interleaf.coordinator.planner.fitting import fit_line

SIZES = (1 << 12, 1 << 18, 1 << 22)
REPEATS = 10


def _link_worker(rank: int, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = {}
    for size in SIZES:
        tensor = torch.zeros(size // 4)
        for kind in ("p2p", "allreduce"):
            times = []
            for _ in range(REPEATS):
                dist.barrier()
                start = time.perf_counter()
                if kind == "allreduce":
                    dist.all_reduce(tensor)
                elif rank == 0:
                    dist.send(tensor, 1)
                    dist.recv(tensor, 1)
                else:
                    dist.recv(tensor, 0)
                    dist.send(tensor, 0)
                elapsed = time.perf_counter() - start
                times.append(elapsed / 2 if kind == "p2p" else elapsed)
            results[(kind, size)] = times
    if rank == 0:
        out.put(results)
    dist.destroy_process_group()


@contextlib.contextmanager
def _children_ignore_ctrl_c():
    """Processes started inside ignore SIGINT: a terminal's Ctrl-C reaches its whole
    foreground group, and each worker would print its own KeyboardInterrupt traceback
    (deep in torch's imports, or in its loop) beside the command's one-line message; the
    probe stops them instead. An ignored signal stays ignored across exec, and Python
    installs its SIGINT handler only where SIGINT is at its default. (Outside the main
    thread no handler can be set, nor can Ctrl-C be taken there.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def measure_links() -> dict[str, Law]:
    """Latency and bandwidth of a gloo message and all-reduce between two processes."""
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    out = context.SimpleQueue()
    with _children_ignore_ctrl_c():
        workers = mp.start_processes(_link_worker, args=(port, out), nprocs=2, join=False, start_method="spawn")
    try:
        while not workers.join():
            pass
    except BaseException:  # Ctrl-C, or a worker's failure: neither worker outlives the probe
        for process in workers.processes:
            if process.is_alive():
                process.terminate()
            process.join()
        raise
    results = out.get()
    return {kind: fit_line([(size, seconds) for size in SIZES for seconds in results[(kind, size)]])
            for kind in ("p2p", "allreduce")}
