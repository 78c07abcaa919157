"""Schedules as data: compute order, lowering passes, validation and simulation.

No processes: programs are built, checked and simulated in memory. Bubble fractions
are compared with the closed forms from Narayanan et al. 2021 (§2.2) at rel_tol=1e-9.
"""

from __future__ import annotations

import math

import pytest

from interleaf.coordinator.schedule import (CostModel, build_programs, compute_order,
                                  peak_activations, simulate, validate_programs)
from interleaf.protos.actions import (Action, Kind, format_program, parse,
                                          parse_program)
from interleaf.coordinator.schedule.placement import round_robin
from interleaf.coordinator.schedule.lowering import add_gradient_sync, add_p2p

F, B = Kind.FORWARD, Kind.BACKWARD


def _layouts(pps=(1, 2, 3, 4, 8), multiples=(1, 2, 3)):
    """(schedule, pp, vpp, microbatches) for every schedule, vpp 1..3 where allowed."""
    for schedule in ("gpipe", "1f1b", "interleaved-1f1b"):
        for pp in pps:
            for vpp in ((1, 2, 3) if schedule == "interleaved-1f1b" else (1,)):
                for k in multiples:
                    yield schedule, pp, vpp, pp * k


def _compute(program):
    return [a for a in program if a.kind in (F, B)]


# --- the action vocabulary -------------------------------------------------------------

def test_every_kind_round_trips_through_its_string():
    actions = [Action(F, 3, 1), Action(B, 3, 1), Action(Kind.BACKWARD_INPUT, 3, 1),
               Action(Kind.BACKWARD_WEIGHT, 3, 1), Action(Kind.SEND_ACT, 3, 1, 2),
               Action(Kind.RECV_ACT, 4, 1, 1), Action(Kind.SEND_GRAD, 4, 1, 1),
               Action(Kind.RECV_GRAD, 3, 1, 2), Action(Kind.REDUCE_GRADS, 3),
               Action(Kind.REDUCE_SCATTER_GRADS, 3), Action(Kind.GATHER_PARAMS, 5),
               Action(Kind.RELEASE_PARAMS, 5),
               Action(Kind.REDUCE_TIED_GRADS), Action(Kind.OPTIMIZER_STEP),
               Action(Kind.EXCHANGE, members=(Action(Kind.SEND_ACT, 3, 1, 2),
                                              Action(Kind.RECV_GRAD, 3, 0, 2)))]
    assert {a.kind for a in actions} == set(Kind)
    assert [str(a) for a in actions] == ["F3.1", "B3.1", "I3.1", "W3.1", "SA3.1>2", "RA4.1<1", "SG4.1>1",
                                         "RG3.1<2", "DP3", "RS3", "AG5", "RP5", "TIE", "OPT",
                                         "SA3.1>2+RG3.0<2"]
    assert [parse(str(a)) for a in actions] == actions


def test_built_programs_round_trip_through_text():
    for program in build_programs("interleaved-1f1b", 4, 2, 8, dp=2):
        assert parse_program(format_program(program)) == program


# --- compute order ---------------------------------------------------------------------

def test_gpipe_runs_all_forwards_then_all_backwards():
    assert format_program(compute_order("gpipe", 2, 1, 3)[1]) == \
        "F1.0 F1.1 F1.2 B1.0 B1.1 B1.2"


def test_1f1b_warms_up_pp_minus_rank_minus_one_forwards():
    orders = compute_order("1f1b", 2, 1, 4)
    assert format_program(orders[0]) == "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3"
    assert format_program(orders[1]) == "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3"


def test_interleaved_sweeps_chunks_in_groups_of_pp_microbatches():
    orders = compute_order("interleaved-1f1b", 2, 2, 4)
    # Rank 0 warmup = (2-0-1)*2 + (2-1)*2 = 4; backwards walk the chunks in reverse.
    assert format_program(orders[0]) == ("F0.0 F0.1 F2.0 F2.1 F0.2 B2.0 F0.3 B2.1 "
                                         "F2.2 B0.0 F2.3 B0.1 B2.2 B2.3 B0.2 B0.3")
    assert format_program(orders[1]) == ("F1.0 F1.1 F3.0 B3.0 F3.1 B3.1 F1.2 B1.0 "
                                         "F1.3 B1.1 F3.2 B3.2 F3.3 B3.3 B1.2 B1.3")


def test_interleaved_with_one_chunk_per_rank_is_1f1b():
    assert compute_order("interleaved-1f1b", 4, 1, 6) == compute_order("1f1b", 4, 1, 6)


@pytest.mark.parametrize("args, words", [
    (("gpipe", 2, 2, 4), "vpp=2 must be 1 for gpipe"),
    (("1f1b", 2, 3, 4), "vpp=3 must be 1 for 1f1b"),
    (("interleaved-1f1b", 4, 2, 6), "microbatches=6 must be a multiple of pp=4"),
    (("zero-bubble", 2, 1, 4), "schedule='zero-bubble' must be one of"),
    (("1f1b", 0, 1, 4), "pp=0 must be at least 1"),
    (("gpipe", 2, 1, 0), "microbatches=0 must be at least 1"),
])
def test_invalid_combinations_are_refused(args, words):
    with pytest.raises(ValueError, match=words):
        compute_order(*args)


# --- lowering passes ---------------------------------------------------------------------

def test_p2p_wraps_compute_in_receives_and_sends():
    programs = add_p2p(compute_order("1f1b", 2, 1, 2), round_robin(2, 1))
    assert format_program(programs[0]) == \
        "F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1"
    assert format_program(programs[1]) == \
        "RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1 B1.1 SG1.1>0"


def test_p2p_chunks_at_the_ends_talk_only_inward():
    # pp=2, vpp=2: chunk 3 is last (no SA, no RG); chunk 0 is first (no RA, no SG).
    programs = add_p2p(compute_order("interleaved-1f1b", 2, 2, 2), round_robin(2, 2))
    kinds_by_chunk = {}
    for program in programs:
        for a in program:
            if a.kind not in (F, B):
                kinds_by_chunk.setdefault(a.chunk, set()).add(a.kind)
    assert kinds_by_chunk[0] == {Kind.SEND_ACT, Kind.RECV_GRAD}
    assert kinds_by_chunk[3] == {Kind.RECV_ACT, Kind.SEND_GRAD}
    assert kinds_by_chunk[1] == kinds_by_chunk[2] == {
        Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD}


def test_single_rank_hands_tensors_over_locally():
    (program,) = add_p2p(compute_order("interleaved-1f1b", 1, 3, 2), round_robin(1, 3))
    assert program == compute_order("interleaved-1f1b", 1, 3, 2)[0]


@pytest.mark.parametrize("schedule, pp, vpp, m", [("1f1b", 4, 1, 8), ("gpipe", 3, 1, 3),
                                                   ("interleaved-1f1b", 4, 3, 8),
                                                   ("interleaved-1f1b", 1, 2, 2)])
def test_reduce_grads_follows_each_chunks_last_backward(schedule, pp, vpp, m):
    for rank, program in enumerate(build_programs(schedule, pp, vpp, m, dp=2)):
        reduced = [i for i, a in enumerate(program) if a.kind is Kind.REDUCE_GRADS]
        assert sorted(program[i].chunk for i in reduced) == list(range(rank, pp * vpp, pp))
        for i in reduced:
            chunk = program[i].chunk
            last_b = max(j for j, a in enumerate(program) if a.kind is B and a.chunk == chunk)
            # Directly behind the backward and the send of its input gradient, if any
            # (alone or in an exchange, perhaps after receives that came due meanwhile).
            sent = Action(Kind.SEND_GRAD, chunk, program[last_b].microbatch, (chunk - 1) % pp)
            between = program[last_b + 1:i]
            assert all(a.p2p_ops() for a in between)
            if chunk > 0 and pp > 1:
                assert sent in between[-1].p2p_ops()
            else:
                assert between == []


def test_no_data_parallel_means_no_reduce_grads():
    for program in build_programs("interleaved-1f1b", 2, 2, 4, dp=1):
        assert all(a.kind is not Kind.REDUCE_GRADS for a in program)


@pytest.mark.parametrize("pp", [1, 2, 3, 4])
def test_tie_only_on_first_and_last_rank_and_optimizer_last(pp):
    programs = build_programs("1f1b", pp, 1, 2 * pp, dp=2)
    ties = [r for r, p in enumerate(programs) if Action(Kind.REDUCE_TIED_GRADS) in p]
    assert ties == ([] if pp == 1 else sorted({0, pp - 1}))
    for program in programs:
        assert program[-1] == Action(Kind.OPTIMIZER_STEP)
        assert program.count(Action(Kind.OPTIMIZER_STEP)) == 1
        last_backward = max(i for i, a in enumerate(program) if a.kind is B)
        assert all(i > last_backward for i, a in enumerate(program)
                   if a.kind is Kind.REDUCE_TIED_GRADS)


def test_untied_model_gets_no_tie_reduction():
    program = add_p2p(compute_order("1f1b", 2, 1, 2), round_robin(2, 1))[0]
    synced = add_gradient_sync(program, 0, round_robin(2, 1), 1, tied_embedding_pipeline=False)
    assert synced == program + [Action(Kind.OPTIMIZER_STEP)]


def test_gradient_sync_refuses_a_program_missing_an_owned_chunk():
    program = [Action(F, 0, 0), Action(B, 0, 0)]  # rank 0 of pp=2, vpp=2 also owns chunk 2
    with pytest.raises(ValueError, match="owns chunk 2"):
        add_gradient_sync(program, 0, round_robin(2, 2), 2, tied_embedding_pipeline=True)


# --- every layout validates and runs ------------------------------------------------------

@pytest.mark.parametrize("dp", [1, 2])
@pytest.mark.parametrize("schedule, pp, vpp, m", list(_layouts()))
def test_every_layout_validates_and_simulates(schedule, pp, vpp, m, dp):
    programs = build_programs(schedule, pp, vpp, m, dp)
    validate_programs(programs, pp, vpp, m)
    result = simulate(programs, CostModel(forward_s=1.0, backward_s=2.0))
    assert result.busy_s == [3.0 * m * vpp] * pp


# --- bubble fraction -----------------------------------------------------------------------

@pytest.mark.parametrize("forward_s, backward_s", [(1.0, 1.0), (0.5, 0.5), (1.0, 2.0)])
@pytest.mark.parametrize("schedule, pp, vpp, m", list(_layouts(multiples=(1, 2, 4))))
def test_bubble_fraction_matches_closed_form(schedule, pp, vpp, m, forward_s, backward_s):
    # Per-chunk costs scaled by 1/vpp (a full stage costs forward_s + backward_s).
    cost = CostModel(forward_s=forward_s / vpp, backward_s=backward_s / vpp)
    result = simulate(build_programs(schedule, pp, vpp, m, dp=2), cost)
    expected = (pp - 1) / (vpp * m + pp - 1)
    assert math.isclose(result.bubble_fraction, expected, rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(result.makespan_s,
                        (vpp * m + pp - 1) * (forward_s + backward_s) / vpp, rel_tol=1e-9)


def test_link_cost_adds_two_transfers_per_extra_stage():
    # GPipe with eager links: forwards cross pp-1 links on the way out, gradients pp-1
    # on the way back. (Under rendezvous semantics each send also holds its sender for
    # the transfer: tests/test_rendezvous.py.)
    pp, m = 4, 6
    cost = CostModel(forward_s=1.0, backward_s=2.0, latency_s=0.25, message_bytes=1000,
                     bandwidth_bytes_per_s=4000.0)
    result = simulate(build_programs("gpipe", pp, 1, m, dp=1), cost, links="eager")
    assert math.isclose(result.makespan_s, (m + pp - 1) * 3.0 + 2 * (pp - 1) * 0.5)
    assert result.bubble_fraction > (pp - 1) / (m + pp - 1)


def test_reductions_and_optimizer_are_charged_and_tie_waits_for_both_ranks():
    cost = CostModel(forward_s=1.0, backward_s=1.0, reduce_s=0.5, optimizer_s=0.25)
    (single,) = build_programs("interleaved-1f1b", 1, 2, 3, dp=2)
    # One rank: 2 chunks x 3 microbatches x (F+B), two DP reductions, the local sum of
    # the two tied-embedding copies, one step.
    assert Action(Kind.REDUCE_TIED_GRADS) in single
    assert simulate([single], cost).makespan_s == 12.0 + 3 * 0.5 + 0.25
    result = simulate(build_programs("1f1b", 3, 1, 3, dp=1), cost)
    ties = [[s for s in spans if s.action.kind is Kind.REDUCE_TIED_GRADS]
            for spans in result.timeline]
    assert ties[1] == []
    assert ties[0][0].end == ties[2][0].end == max(ties[0][0].start, ties[2][0].start) + 0.5
    assert ties[0][0].start != ties[2][0].start  # rank 2 finishes earlier and waits


@pytest.mark.parametrize("links", ["eager", "rendezvous"])
def test_replay_charges_posting_before_the_message_leaves(links):
    # GPipe, pp=2, one microbatch: F0.0 SA0.0>1 RG0.0<1 B0.0 TIE OPT on rank 0 and
    # RA1.0<0 F1.0 B1.0 SG1.0>0 TIE OPT on rank 1, replayed with measured computes
    # (forward 1 s, backward 2 s) and posting (rank 0's send 0.5 s, rank 1's receive
    # 0.25 s, rank 1's send 0.125 s).
    programs = build_programs("gpipe", 2, 1, 1, dp=1)
    costs = {"F0.0": 1.0, "B0.0": 2.0, "SA0.0>1": 0.5, "RA1.0<0": 0.25, "F1.0": 1.0, "B1.0": 2.0,
             "SG1.0>0": 0.125}
    result = simulate(programs, CostModel(), links=links,
                      measured=[[costs.get(str(a)) for a in program] for program in programs])
    spans = [{str(s.action): (s.start, s.end) for s in timeline} for timeline in result.timeline]
    assert spans[0]["SA0.0>1"] == (1.0, 1.5)  # posting holds its rank
    assert spans[1]["F1.0"] == (1.5, 2.5)  # the message left when its posting ended
    assert spans[1]["SG1.0>0"] == (4.5, 4.625)
    assert spans[0]["B0.0"] == (4.625, 6.625)
    # Computes 6 s of the 2 x 6.625 rank-seconds; posting is idle time, as on a server.
    assert result.bubble_fraction == pytest.approx(1 - 6.0 / 13.25)


def test_cost_model_refuses_negative_costs():
    with pytest.raises(ValueError, match="CostModel.latency_s=-1"):
        CostModel(latency_s=-1)
    with pytest.raises(ValueError, match="bandwidth_bytes_per_s=0"):
        CostModel(bandwidth_bytes_per_s=0)


# --- activation memory ---------------------------------------------------------------------

@pytest.mark.parametrize("pp, m", [(2, 8), (4, 8), (4, 16), (8, 16)])
def test_1f1b_bounds_in_flight_microbatches_by_pipeline_depth(pp, m):
    gpipe = compute_order("gpipe", pp, 1, m)
    one_f_one_b = compute_order("1f1b", pp, 1, m)
    assert [peak_activations(p) for p in gpipe] == [m] * pp
    assert [peak_activations(p) for p in one_f_one_b] == [pp - r for r in range(pp)]
    assert peak_activations(one_f_one_b[0]) <= pp < m


@pytest.mark.parametrize("pp, vpp, m", [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (8, 2, 8)])
def test_interleaved_holds_warmup_plus_one(pp, vpp, m):
    orders = compute_order("interleaved-1f1b", pp, vpp, m)
    for rank, order in enumerate(orders):
        warmup = min((pp - rank - 1) * 2 + (vpp - 1) * pp, vpp * m)
        assert peak_activations(order) == min(warmup + 1, vpp * m)
