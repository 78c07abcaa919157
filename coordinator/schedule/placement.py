"""Which pipeline rank holds each model chunk: a property of the schedule.

Every schedule but zbv places chunks round-robin (Megatron-LM's virtual pipeline):
chunk c on rank c % pp, so with pp=4, vpp=2 rank 1 holds chunks 1 and 5. zbv (Qi et
al. 2024, "ZB-V") places the 2*pp chunks in a V: rank r holds chunk r on the way down
and chunk 2*pp-1-r on the way back up, so the last rank runs the two middle chunks
back to back and the first rank holds both the embedding and the head.

    pp=4, vpp=2     chunk:  0 1 2 3 4 5 6 7
    round-robin     rank:   0 1 2 3 0 1 2 3
    V (zbv)         rank:   0 1 2 3 3 2 1 0

Lowering (peers of sends and receives), the validator, the partition a job's servers
receive, the tied-embedding reduction and the pictures all read the placement from
here. Checkpoints are written by parameter name, so a job resumes under any placement.
"""

from __future__ import annotations

V_SCHEDULES = ("zbv",)


def chunk_ranks(schedule: str, pp: int, vpp: int) -> tuple[int, ...]:
    """The pipeline rank of each chunk 0 .. pp*vpp-1."""
    if schedule in V_SCHEDULES:
        if vpp != 2:
            raise ValueError(f"vpp={vpp} must be 2 for {schedule}: its V places two chunks on each rank")
        return tuple(range(pp)) + tuple(reversed(range(pp)))
    return tuple(c % pp for c in range(pp * vpp))


def chunks_on(placement: tuple[int, ...], rank: int) -> list[int]:
    """The chunks `placement` puts on `rank`, in chunk order."""
    return [c for c, r in enumerate(placement) if r == rank]


def round_robin(pp: int, vpp: int) -> tuple[int, ...]:
    return chunk_ranks("interleaved-1f1b", pp, vpp)


def tie_ranks(placement: tuple[int, ...]) -> tuple[int, int]:
    """The ranks of the first and the last chunk: where the tied embedding's two copies
    live (one rank, summing them locally, when they coincide)."""
    return placement[0], placement[-1]
