"""Admission: a job runs only where the memory model says it fits (DESIGN.md, "Memory
model and admission"), checked before any server allocates anything."""

from __future__ import annotations

from interleaf.coordinator.config import ConfigError, JobConfig
from interleaf.coordinator.grid import RankGrid
from interleaf.coordinator.memory_model import predict, with_temporaries
from interleaf.protos.actions import Action

RUNTIME_RESERVE_BYTES = 512 << 20
"""What a stage server's process needs beside the job's tensors: an idle server (Python,
torch, grpc) has a resident set of about 240 MB; gloo's buffers and torch's kernel
workspaces add to it once a job runs."""


class AdmissionError(ConfigError):
    """A job the servers' memory cannot hold; the message names the rank, the bytes
    needed and the bytes available."""


def needed_bytes(config: JobConfig, programs: list[list[Action]], device_type: str = "cpu") -> list[int]:
    """Bytes each rank needs (by rank) on servers of `device_type`: its predicted peak,
    the loss's forward temporaries on top, plus the runtime reserve."""
    p = config.parallel
    per_stage = [with_temporaries(prediction) + RUNTIME_RESERVE_BYTES
                 for prediction in predict(config, programs, device_type)]
    grid = RankGrid(p.dp, p.pp, p.tp)
    return [per_stage[grid.coord(rank).pp] for rank in range(grid.world_size)]


def amount_text(size: float) -> str:
    """Bytes for a person: GiB to two places, MiB below one GiB and bytes below one MiB
    (where 0.00 GiB would say nothing)."""
    if size >= 2**30:
        return f"{size / 2**30:.2f} GiB"
    return f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{int(size):,} bytes"


def check_fits(needs: list[int], offers: list[tuple[str, int]]) -> None:
    """Raises AdmissionError unless enough of the servers `offers` ((address, memory
    bytes)) can host any rank: placement (plan.place_servers) gives every rank a server
    offering the most any rank needs."""
    if len(offers) < len(needs):
        raise ValueError(f"{len(offers)} servers for {len(needs)} ranks")
    rank = max(range(len(needs)), key=needs.__getitem__)
    need = needs[rank]
    fitting = sum(memory >= need for _, memory in offers)
    if fitting < len(needs):
        address, memory = max((o for o in offers if o[1] < need), key=lambda o: o[1])
        raise AdmissionError(
            f"rank {rank} needs {need} bytes ({amount_text(need)}: its predicted peak, with the loss's forward temporaries, plus "
            f"{amount_text(RUNTIME_RESERVE_BYTES)} for the process) but server {address} offers {memory} "
            f"bytes ({amount_text(memory)}), and only {fitting} of {len(offers)} servers offer that much "
            f"for {len(needs)} ranks; more parallelism, a ZeRO stage or a smaller model would need "
            f"less (`interleaf schedule` shows the prediction)"
        )
