"""The zero-bubble schedules as data: zb-h1 and zbv orders, the V placement, their
lowering under every ZeRO stage, and the simulated bubbles against 1F1B and
interleaved 1F1B."""

from __future__ import annotations

import pytest

from interleaf.coordinator.partition import partition
from interleaf.coordinator.schedule import (CostModel, ProgramError, build_programs, compute_order,
                                            peak_activations, simulate, validate_programs)
from interleaf.coordinator.schedule.forward_only import build_eval_programs
from interleaf.coordinator.schedule.placement import chunk_ranks, chunks_on
from interleaf.coordinator.schedule.zero import max_gathered
from interleaf.protos.actions import READS_PARAMS, WEIGHT_GRADS, Action, Kind, format_program, parse_program

GRID = [(2, 1), (2, 4), (3, 5), (4, 8), (4, 16), (8, 16), (4, 3)]
"""(pp, microbatches): even and uneven, fewer microbatches than ranks included."""


def bubble(schedule: str, pp: int, vpp: int, m: int, cost: CostModel = CostModel()) -> float:
    programs = build_programs(schedule, pp, vpp, m, dp=1)
    return simulate(programs, cost, links="rendezvous").bubble_fraction


def test_the_docstring_orders():
    assert [format_program(o) for o in compute_order("zb-h1", 2, 1, 4)] == [
        "F0.0 F0.1 I0.0 W0.0 F0.2 I0.1 W0.1 F0.3 I0.2 W0.2 I0.3 W0.3",
        "F1.0 I1.0 F1.1 I1.1 W1.0 F1.2 I1.2 W1.1 F1.3 I1.3 W1.2 W1.3",
    ]
    assert [format_program(o) for o in compute_order("zbv", 2, 2, 4)] == [
        "F0.0 F0.1 F0.2 F3.0 I3.0 W3.0 F3.1 I0.0 I3.1 W0.0 F0.3 I0.1 W3.1 F3.2 I3.2 W0.1 "
        "W3.2 I0.2 W0.2 F3.3 I3.3 W3.3 I0.3 W0.3",
        "F1.0 F2.0 F1.1 F2.1 I2.0 I1.0 W2.0 F1.2 I2.1 I1.1 W1.0 F2.2 W2.1 F1.3 I2.2 I1.2 "
        "W1.1 F2.3 W2.2 W1.2 I2.3 I1.3 W2.3 W1.3",
    ]


def test_v_placement_puts_the_ends_on_rank_0_and_the_turn_on_the_last_rank():
    assert chunk_ranks("zbv", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)
    assert chunk_ranks("interleaved-1f1b", 4, 2) == (0, 1, 2, 3, 0, 1, 2, 3)
    assert chunks_on(chunk_ranks("zbv", 4, 2), 1) == [1, 6]
    chunks = partition(8, 4, 2, "zbv")
    assert [c.pipeline_rank for c in chunks] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert chunks[0].has_embedding and chunks[-1].has_head and chunks[-1].pipeline_rank == 0
    with pytest.raises(ValueError, match="vpp=3 must be 2 for zbv"):
        chunk_ranks("zbv", 2, 3)


@pytest.mark.parametrize("pp,m", GRID)
def test_zb_h1_bubble_is_below_1f1b_at_1f1b_memory(pp, m):
    assert bubble("zb-h1", pp, 1, m) < bubble("1f1b", pp, 1, m)
    ours = build_programs("zb-h1", pp, 1, m, dp=1)
    theirs = build_programs("1f1b", pp, 1, m, dp=1)
    # Every rank within 1F1B's largest peak (its first rank's).
    assert max(peak_activations(p) for p in ours) == max(peak_activations(p) for p in theirs)


@pytest.mark.parametrize("pp,m", [(pp, m) for pp, m in GRID if m % pp == 0])
def test_zbv_bubble_is_below_interleaved_with_the_same_chunks(pp, m):
    assert bubble("zbv", pp, 2, m) < bubble("interleaved-1f1b", pp, 2, m)
    # The V holds at most 2*pp half-size chunk-microbatches: 1F1B's first-rank bytes.
    assert max(peak_activations(p) for p in build_programs("zbv", pp, 2, m, dp=1)) <= 2 * pp


def test_ideal_bubbles_of_the_paper_with_equal_f_i_w():
    # F = I = W = 1: 1F1B idles (p-1)(F+B) = 3*3 ticks of a rank's step, ZB-H1 (p-1)(F+I-W).
    cost = CostModel(forward_s=1.0, backward_s=2.0)
    pp, m = 4, 8
    one_f_one_b = simulate(build_programs("1f1b", pp, 1, m, dp=1), cost)
    assert one_f_one_b.makespan_s == m * 3 + (pp - 1) * 3
    zb = simulate(build_programs("zb-h1", pp, 1, m, dp=1), cost)
    assert m * 3 + (pp - 1) * 1 <= zb.makespan_s < one_f_one_b.makespan_s


@pytest.mark.parametrize("schedule,vpp", [("zb-h1", 1), ("zbv", 2)])
@pytest.mark.parametrize("pp,m", GRID)
@pytest.mark.parametrize("dp,zero", [(1, 0), (2, 0), (2, 1), (2, 2), (2, 3)])
@pytest.mark.parametrize("tied", [True, False])
def test_programs_validate_and_run_under_rendezvous_links(schedule, vpp, pp, m, dp, zero, tied):
    programs = build_programs(schedule, pp, vpp, m, dp, zero, tied=tied)
    placement = chunk_ranks(schedule, pp, vpp)
    validate_programs(programs, pp, vpp, m, zero, placement=placement)  # simulates under rendezvous
    for rank, program in enumerate(programs):
        kinds = {a.kind for a in program}
        assert Kind.BACKWARD not in kinds and {Kind.BACKWARD_INPUT, Kind.BACKWARD_WEIGHT} <= kinds
        for chunk in chunks_on(placement, rank):
            last_weight = max(i for i, a in enumerate(program) if a.kind in WEIGHT_GRADS and a.chunk == chunk)
            reductions = [i for i, a in enumerate(program)
                          if a.kind in (Kind.REDUCE_GRADS, Kind.REDUCE_SCATTER_GRADS) and a.chunk == chunk]
            assert all(i > last_weight for i in reductions)  # gradients reduced after the last W
            assert bool(reductions) == (zero > 0 or dp > 1)


def test_zero3_gathers_around_what_reads_parameters_and_lets_w_run_released():
    programs = build_programs("zbv", 4, 2, 8, dp=2, zero=3)
    for program in programs:
        gathered: set[int] = set()
        released_w = 0
        for a in program:
            if a.kind is Kind.GATHER_PARAMS:
                gathered.add(a.chunk)
            elif a.kind is Kind.RELEASE_PARAMS:
                gathered.discard(a.chunk)
            elif a.kind in READS_PARAMS:
                assert a.chunk in gathered
            elif a.kind is Kind.BACKWARD_WEIGHT:
                released_w += a.chunk not in gathered
        assert max_gathered(program) <= 2
        assert released_w > 0  # some W run where the chunk is released, as they may


def test_the_tie_is_summed_locally_when_the_v_puts_both_copies_on_rank_0():
    programs = build_programs("zbv", 4, 2, 8, dp=1, tied=True)
    assert [sum(a.kind is Kind.REDUCE_TIED_GRADS for a in p) for p in programs] == [1, 0, 0, 0]
    assert [sum(a.kind is Kind.REDUCE_TIED_GRADS for a in p)
            for p in build_programs("zb-h1", 4, 1, 8, dp=1, tied=True)] == [1, 0, 0, 1]


def test_the_turn_of_the_v_is_handed_over_locally():
    last = build_programs("zbv", 3, 2, 3, dp=1)[2]
    moved = {(op.kind, op.chunk) for a in last for op in a.p2p_ops()}
    # Chunks 2 and 3 are both on rank 2: 2's output and 3's input gradient never leave it.
    assert (Kind.SEND_ACT, 2) not in moved and (Kind.RECV_ACT, 3) not in moved
    assert (Kind.SEND_GRAD, 3) not in moved and (Kind.RECV_GRAD, 2) not in moved
    assert (Kind.SEND_ACT, 3) in moved and (Kind.RECV_ACT, 2) in moved


def test_evaluation_programs_follow_the_v():
    programs = build_eval_programs("zbv", 4, 2, 6, zero=3)
    validate_programs(programs, 4, 2, 6, 3, forward_only=True, placement=chunk_ranks("zbv", 4, 2))


def test_validator_refuses_round_robin_peers_under_the_v_and_half_a_split():
    programs = build_programs("zbv", 2, 2, 2, dp=1)
    with pytest.raises(ProgramError, match="does not live on rank"):
        validate_programs(programs, 2, 2, 2)  # checked against round-robin
    split = build_programs("zb-h1", 2, 1, 2, dp=1)
    split[1].remove(Action(Kind.BACKWARD_WEIGHT, 1, 0))
    with pytest.raises(ProgramError, match="program lacks W1.0"):
        validate_programs(split, 2, 1, 2)
    swapped = build_programs("zb-h1", 2, 1, 2, dp=1)
    i, w = swapped[1].index(Action(Kind.BACKWARD_INPUT, 1, 0)), swapped[1].index(Action(Kind.BACKWARD_WEIGHT, 1, 0))
    swapped[1][i], swapped[1][w] = swapped[1][w], swapped[1][i]
    with pytest.raises(ProgramError, match="weight-gradient backward before I1.0"):
        validate_programs(swapped, 2, 1, 2)
    both = parse_program("F0.0 B0.0 I0.0 W0.0 OPT")
    with pytest.raises(ProgramError, match="runs both the fused backward and its halves"):
        validate_programs([both], 1, 1, 1)


def test_no_tie_group_where_the_v_keeps_both_copies_on_one_rank():
    from interleaf.coordinator.grid import RankGrid
    from interleaf.coordinator.schedule.placement import tie_ranks
    v = RankGrid(2, 4, 1, tie_ranks(chunk_ranks("zbv", 4, 2)))
    assert not [name for name in v.all_groups() if name.startswith("tie/")]
    assert RankGrid(2, 4, 1, tie_ranks(chunk_ranks("zb-h1", 4, 1))).all_groups()["tie/d1/t0"] == [4, 7]
