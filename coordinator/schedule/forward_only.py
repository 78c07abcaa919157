"""Evaluation programs: the forwards of a schedule, lowered like a training step but with
no backward, so no gradient buffers, reductions or optimizer step.

The compute order is the training schedule's own with its backwards dropped (Megatron's
`forward_only=True`): 1F1B and GPipe run each rank's forwards in microbatch order,
interleaved 1F1B sweeps its chunks in groups of pp microbatches, the zero-bubble
schedules keep their greedy order's forwards, so the pipeline fills as in training. Point-to-point goes through the same passes (`add_p2p`, then
`fuse.place_p2p` at each message's tick, which keeps the programs free of deadlock under
rendezvous semantics), and ZeRO-3 gathers each chunk's parameters around its runs of
forwards and releases them after, as `zero.add_param_gathers` does for training; ZeRO-1
and 2 need nothing (their parameters are whole again after each optimizer step).
`validate_programs(..., forward_only=True)` and `simulate` check the result as they
check every training program.

Worked example, 1F1B pp=2, 2 microbatches:
    rank 0: F0.0 SA0.0>1 F0.1 SA0.1>1
    rank 1: RA1.0<0 F1.0 RA1.1<0 F1.1
and with ZeRO-3 (prefetch 1) rank 0 runs AG0 F0.0 SA0.0>1 F0.1 RP0 SA0.1>1.
"""

from __future__ import annotations

from interleaf.protos.actions import Action, Kind

from .compute_order import compute_order
from .fuse import place_p2p
from .lowering import add_p2p
from .placement import chunk_ranks
from .zero import add_param_gathers


def forward_order(schedule: str, pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the schedule's forwards in its own order."""
    return [[a for a in order if a.kind is Kind.FORWARD] for order in compute_order(schedule, pp, vpp, microbatches)]


def build_eval_programs(schedule: str, pp: int, vpp: int, microbatches: int, zero: int = 0,
                        prefetch: int = 1) -> list[list[Action]]:
    """One forward-only program per pipeline rank (its DP and TP replicas run the same)."""
    programs = place_p2p(add_p2p(forward_order(schedule, pp, vpp, microbatches), chunk_ranks(schedule, pp, vpp)))
    if zero == 3:
        programs = [add_param_gathers(program, prefetch) for program in programs]
    return programs
