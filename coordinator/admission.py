"""Admission: a job runs only where the memory model says it fits (DESIGN.md, "Memory
model and admission"), checked before any server allocates anything."""

from __future__ import annotations

from coordinator.config import ConfigError, JobConfig
from coordinator.grid import RankGrid
from coordinator.memory_model import predict
from protos.actions import Action

RUNTIME_RESERVE_BYTES = 512 << 20
"""What a stage server's process needs beside the job's tensors: an idle server (Python,
torch, grpc) has a resident set of about 240 MB; gloo's buffers and torch's kernel
workspaces add to it once a job runs."""


class AdmissionError(ConfigError):
    """A job the servers' memory cannot hold; the message names the rank, the bytes
    needed and the bytes available."""


def needed_bytes(config: JobConfig, programs: list[list[Action]]) -> list[int]:
    """Bytes each rank needs (by rank): its predicted peak plus the runtime reserve."""
    p = config.parallel
    per_stage = [prediction["peak_bytes"] + RUNTIME_RESERVE_BYTES for prediction in predict(config, programs)]
    grid = RankGrid(p.dp, p.pp, p.tp)
    return [per_stage[grid.coord(rank).pp] for rank in range(grid.world_size)]


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_fits(needs: list[int], offers: list[tuple[str, int]]) -> None:
    """Raises AdmissionError unless the servers `offers` ((address, memory bytes)) can
    host every rank: the most demanding ranks are matched with the largest servers."""
    if len(offers) < len(needs):
        raise ValueError(f"{len(offers)} servers for {len(needs)} ranks")
    ranks = sorted(range(len(needs)), key=lambda r: -needs[r])
    servers = sorted(offers, key=lambda s: -s[1])
    for rank, (address, memory) in zip(ranks, servers):
        if needs[rank] > memory:
            raise AdmissionError(
                f"rank {rank} needs {needs[rank]} bytes ({_gib(needs[rank])}: its predicted peak "
                f"plus {_gib(RUNTIME_RESERVE_BYTES)} for the process) but server {address} offers "
                f"{memory} bytes ({_gib(memory)}); a higher parallel.zero, more parallelism or a "
                f"smaller model would need less (see `interleaf schedule`)"
            )
