"""Pass 1 of lowering: the order in which each pipeline rank runs forwards and backwards.

Only computes come out of here: FORWARD and BACKWARD, or for the zero-bubble schedules
(zero_bubble.py) FORWARD, BACKWARD_INPUT and BACKWARD_WEIGHT; communication, gradient
reduction and the optimizer step are added by the passes in `lowering.py`.
"""

from __future__ import annotations

from collections.abc import Callable

from interleaf.protos.actions import Action, Kind

from .placement import chunk_ranks
from .zero_bubble import zb_h1_order, zero_bubble_orders

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv")
CHUNKS_PER_RANK = {"zbv": 2}
"""Schedules that run a fixed number of chunks per rank (vpp); interleaved-1f1b takes
any, the others one."""


def compute_order(schedule: str, pp: int, vpp: int, microbatches: int) -> list[list[Action]]:
    """Per pipeline rank, the ordered forwards and backwards of one training step.

    Worked example, pp=2, vpp=1, microbatches=4, "1f1b" (PipeDream-Flush):
        rank 0: F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3
        rank 1: F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3
    """
    _check(schedule, pp, vpp, microbatches)
    if schedule == "gpipe":
        return [_gpipe(rank, microbatches) for rank in range(pp)]
    if schedule == "zb-h1":
        return [zb_h1_order(rank, pp, microbatches) for rank in range(pp)]
    if schedule == "zbv":
        # The same bytes: 2*pp microbatches of chunks half the size.
        return zero_bubble_orders(chunk_ranks(schedule, pp, vpp), microbatches, [2 * pp] * pp)
    if schedule == "1f1b" or vpp == 1:
        # Interleaving one chunk per rank is plain 1F1B; Megatron's interleaved warmup
        # formula would only add needless in-flight microbatches here.
        return [_one_f_one_b(rank, pp, microbatches) for rank in range(pp)]
    return [_interleaved(rank, pp, vpp, microbatches) for rank in range(pp)]


def _check(schedule: str, pp: int, vpp: int, microbatches: int) -> None:
    # The config layer validates with field names; this guards direct callers.
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} must be one of {', '.join(SCHEDULES)}")
    for name, value in (("pp", pp), ("vpp", vpp), ("microbatches", microbatches)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1")
    if schedule in CHUNKS_PER_RANK and vpp != CHUNKS_PER_RANK[schedule]:
        raise ValueError(f"vpp={vpp} must be {CHUNKS_PER_RANK[schedule]} for {schedule}")
    if schedule not in CHUNKS_PER_RANK and schedule != "interleaved-1f1b" and vpp != 1:
        raise ValueError(f"vpp={vpp} must be 1 for {schedule}; only interleaved-1f1b and zbv "
                         f"run several chunks per rank")
    if schedule == "interleaved-1f1b" and vpp > 1 and microbatches % pp:
        raise ValueError(f"microbatches={microbatches} must be a multiple of pp={pp} "
                         f"for interleaved-1f1b")


def _gpipe(rank: int, microbatches: int) -> list[Action]:
    forwards = [Action(Kind.FORWARD, rank, m) for m in range(microbatches)]
    backwards = [Action(Kind.BACKWARD, rank, m) for m in range(microbatches)]
    return forwards + backwards


def _one_f_one_b(rank: int, pp: int, microbatches: int) -> list[Action]:
    # Rank r must run pp-r-1 forwards before the first gradient can come back from the
    # last stage (PipeDream-Flush, Narayanan et al. 2021, §2.2); this also bounds the
    # activations it holds to pp-r microbatches instead of all of them.
    warmup = min(pp - rank - 1, microbatches)
    return _warmup_steady_cooldown(
        warmup, microbatches,
        lambda k: Action(Kind.FORWARD, rank, k),
        lambda k: Action(Kind.BACKWARD, rank, k),
    )


def _interleaved(rank: int, pp: int, vpp: int, microbatches: int) -> list[Action]:
    """Megatron-LM's virtual pipeline (Narayanan et al. 2021, §2.2, Fig. 4).

    The rank walks microbatches*vpp "virtual microbatches" k. Forwards sweep its chunks
    in groups of pp microbatches: with pp=2, vpp=2 rank 0 runs F0.0 F0.1 F2.0 F2.1
    F0.2 F0.3 ...; backwards sweep the chunks in reverse (B2.0 B2.1 B0.0 B0.1 ...).
    """
    group = pp * vpp
    total = microbatches * vpp
    # Megatron's warmup (forward_backward_pipelining_with_interleaving): (vpp-1)*pp
    # forwards bring microbatch 0 to this rank's last chunk, and 2*(pp-rank-1) more keep
    # the rank busy while its gradient makes the round trip downstream and back. With
    # free links pp-rank-1 would already reach the ideal bubble; the extra slack hides
    # link latency (simulate shows both), paid for in activation memory.
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def microbatch(k: int) -> int:
        return (k // group) * pp + k % pp

    def forward(k: int) -> Action:
        local = (k % group) // pp
        return Action(Kind.FORWARD, local * pp + rank, microbatch(k))

    def backward(k: int) -> Action:
        local = vpp - 1 - (k % group) // pp
        return Action(Kind.BACKWARD, local * pp + rank, microbatch(k))

    return _warmup_steady_cooldown(warmup, total, forward, backward)


def _warmup_steady_cooldown(warmup: int, total: int, forward: Callable[[int], Action],
                            backward: Callable[[int], Action]) -> list[Action]:
    """`warmup` forwards, then one forward and one backward at a time, then the rest of
    the backwards; forward(k)/backward(k) name the k-th of each."""
    order = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order
