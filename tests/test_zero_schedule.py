"""ZeRO in the step program, worked examples and the validator: exact programs for
small layouts, and each ZeRO rule the validator enforces broken once. No processes.
Shared helpers and the grid of layouts are in zero_programs.py."""

from __future__ import annotations


import pytest

from interleaf.coordinator.schedule import (ProgramError, build_programs, compute_order,
                                  validate_programs)
from interleaf.coordinator.schedule.zero import add_param_gathers, compute_runs, max_gathered
from interleaf.protos.actions import format_program, parse, parse_program
from tests.zero_programs import (B, RS, F)

# --- worked examples -------------------------------------------------------------------

def test_zero1_reduce_scatters_after_last_backward_and_gathers_after_the_step():
    """1F1B, pp=2, m=2: RS c where DP c would go (after the last backward and its send),
    then TIE, OPT and one AG per owned chunk to rebuild the updated parameters."""
    programs = build_programs("1f1b", 2, 1, 2, dp=2, zero=1)
    assert [format_program(p) for p in programs] == [
        "F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 RG0.1<1 B0.1 RS0 TIE OPT AG0",
        "RA1.0<0 F1.0 RA1.1<0 B1.0 SG1.0>0 F1.1 B1.1 SG1.1>0 RS1 TIE OPT AG1",
    ]


def test_zero1_interleaved_reduces_each_chunk_as_its_backwards_end():
    """Interleaved pp=2, vpp=2, m=4, rank 0: chunk 2's backwards end first, so RS2 goes
    out (behind the exchange that sends B2.3's input gradient) while B0.2 and B0.3
    still run; the gathers follow OPT in chunk order."""
    program = build_programs("interleaved-1f1b", 2, 2, 4, dp=2, zero=1)[0]
    assert format_program(program) == (
        "F0.0 SA0.0>1 F0.1 SA0.1>1+RA2.0<1 F2.0 SA2.0>1+RA2.1<1 F2.1 SA2.1>1 F0.2 SA0.2>1 "
        "RG2.0<1 B2.0 SG2.0>1 RG2.1<1 F0.3 B2.1 SA0.3>1+SG2.1>1+RA2.2<1+RG0.0<1 F2.2 B0.0 "
        "SA2.2>1+RA2.3<1+RG0.1<1 F2.3 B0.1 SA2.3>1+RG2.2<1 B2.2 SG2.2>1 RG2.3<1 B2.3 "
        "SG2.3>1+RG0.2<1 RS2 B0.2 RG0.3<1 B0.3 RS0 TIE OPT AG0 AG2")


@pytest.mark.parametrize("schedule, pp, vpp, m", [("1f1b", 2, 1, 2),
                                                   ("interleaved-1f1b", 2, 2, 4)])
def test_zero2_program_is_zero1s(schedule, pp, vpp, m):
    # Stage 2 differs from stage 1 only in what the server keeps of the full-size
    # gradient after RS, not in what it does when.
    assert build_programs(schedule, pp, vpp, m, dp=2, zero=2) == \
        build_programs(schedule, pp, vpp, m, dp=2, zero=1)


def test_zero3_prefetch0_interleaved_gathers_each_run_just_before_it():
    """Interleaved pp=2, vpp=2, m=4, rank 0, prefetch 0. Runs of one chunk:
        F0.0 F0.1 | F2.0 F2.1 | F0.2 | B2.0 | F0.3 | B2.1 F2.2 | B0.0 | F2.3 | B0.1 |
        B2.2 B2.3 | B0.2 B0.3
    Each run gets AG in front of the sends, receives and exchanges right before it
    and RP right after its last compute (the send of the result needs no parameters);
    each chunk gets one RS, after its last backward's send, as under ZeRO-1/2."""
    program = build_programs("interleaved-1f1b", 2, 2, 4, dp=2, zero=3, prefetch=0)[0]
    assert format_program(program) == (
        "AG0 F0.0 SA0.0>1 F0.1 RP0 "
        "AG2 SA0.1>1+RA2.0<1 F2.0 SA2.0>1+RA2.1<1 F2.1 RP2 "
        "AG0 SA2.1>1 F0.2 RP0 "
        "AG2 SA0.2>1 RG2.0<1 B2.0 RP2 "
        "AG0 SG2.0>1 RG2.1<1 F0.3 RP0 "
        "AG2 B2.1 SA0.3>1+SG2.1>1+RA2.2<1+RG0.0<1 F2.2 RP2 "
        "AG0 B0.0 RP0 "
        "AG2 SA2.2>1+RA2.3<1+RG0.1<1 F2.3 RP2 "
        "AG0 B0.1 RP0 "
        "AG2 SA2.3>1+RG2.2<1 B2.2 SG2.2>1 RG2.3<1 B2.3 RP2 SG2.3>1+RG0.2<1 RS2 "
        "AG0 B0.2 RG0.3<1 B0.3 RP0 RS0 TIE OPT")
    assert max_gathered(program) == 1


def test_zero3_prefetch1_interleaved_with_two_chunks_keeps_both_gathered():
    """Same layout, prefetch 1: run j's gather goes in front of run j-1. Rank 0 has only
    chunks 0 and 2, which alternate, so each run's gather would land right after the
    release of the same chunk's previous run with no compute in between: the runs merge
    and both chunks stay gathered from the start until their last backward (the most
    prefetch 1 allows, 2 chunks). The RS points are those of prefetch 0."""
    program = build_programs("interleaved-1f1b", 2, 2, 4, dp=2, zero=3, prefetch=1)[0]
    assert format_program(program) == (
        "AG0 AG2 F0.0 SA0.0>1 F0.1 SA0.1>1+RA2.0<1 F2.0 SA2.0>1+RA2.1<1 F2.1 SA2.1>1 "
        "F0.2 SA0.2>1 RG2.0<1 B2.0 SG2.0>1 RG2.1<1 F0.3 B2.1 "
        "SA0.3>1+SG2.1>1+RA2.2<1+RG0.0<1 F2.2 B0.0 SA2.2>1+RA2.3<1+RG0.1<1 F2.3 B0.1 "
        "SA2.3>1+RG2.2<1 B2.2 SG2.2>1 RG2.3<1 B2.3 RP2 SG2.3>1+RG0.2<1 RS2 "
        "B0.2 RG0.3<1 B0.3 RP0 RS0 TIE OPT")
    assert max_gathered(program) == 2
    prefetch0 = build_programs("interleaved-1f1b", 2, 2, 4, dp=2, zero=3, prefetch=0)[0]
    assert [a for a in program if a.kind in (F, B, RS)] == \
        [a for a in prefetch0 if a.kind in (F, B, RS)]


@pytest.mark.parametrize("prefetch", [0, 1])
def test_zero3_1f1b_one_chunk_per_rank_is_one_run(prefetch):
    """1F1B, pp=2, m=4: every compute of a rank is on its one chunk, so the whole step is
    one run: one gather before it, one release and one reduce-scatter after it, whatever
    the prefetch."""
    programs = build_programs("1f1b", 2, 1, 4, dp=2, zero=3, prefetch=prefetch)
    assert [format_program(p) for p in programs] == [
        "AG0 F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 F0.2 SA0.2>1+RG0.1<1 B0.1 "
        "F0.3 SA0.3>1+RG0.2<1 B0.2 RG0.3<1 B0.3 RP0 RS0 TIE OPT",
        "AG1 RA1.0<0 F1.0 RA1.1<0 B1.0 SG1.0>0 F1.1 B1.1 SG1.1>0+RA1.2<0 F1.2 B1.2 "
        "SG1.2>0+RA1.3<0 F1.3 B1.3 RP1 SG1.3>0 RS1 TIE OPT",
    ]


def test_add_param_gathers_worked_example_on_compute_order():
    """One rank, three chunks (interleaved pp=1, vpp=3, m=2); runs
        F0.0 | F1.0 | F2.0 B2.0 | F0.1 | B1.0 F1.1 | B0.0 | F2.1 B2.1 | B1.1 | B0.1
    prefetch 1: run 4's gather (AG1) goes before run 3 (F0.1). Run 5 (B0.0) would be
    gathered in front of run 4, right after run 3 of the same chunk: they merge, so chunk
    0 stays across B1.0 F1.1 (2 chunks held, as prefetch 1 allows)."""
    order = compute_order("interleaved-1f1b", 1, 3, 2)[0]
    assert format_program(add_param_gathers(order, 0)) == (
        "AG0 F0.0 RP0 AG1 F1.0 RP1 AG2 F2.0 B2.0 RP2 AG0 F0.1 RP0 AG1 B1.0 F1.1 RP1 "
        "AG0 B0.0 RP0 AG2 F2.1 B2.1 RP2 AG1 B1.1 RP1 AG0 B0.1 RP0")
    assert format_program(add_param_gathers(order, 1)) == (
        "AG0 AG1 F0.0 RP0 AG2 F1.0 RP1 AG0 F2.0 B2.0 RP2 AG1 F0.1 B1.0 F1.1 RP1 "
        "AG2 B0.0 RP0 AG1 F2.1 B2.1 RP2 AG0 B1.1 RP1 B0.1 RP0")
    assert [max_gathered(add_param_gathers(order, p)) for p in range(4)] == [1, 2, 3, 3]


def test_compute_runs_on_a_hand_written_program():
    program = parse_program("AG2 RA2.0<1 F2.0 SA2.0>1 F2.1 RP2 RG0.0<1 B0.0 RS0 "
                            "B2.0 SG2.0>1 F2.2 B0.1")
    runs = compute_runs(program)
    assert [(r.chunk, r.indices) for r in runs] == [(2, (2, 4)), (0, (7,)), (2, (9, 11)),
                                                    (0, (12,))]
    assert [str(program[i]) for i in runs[2].indices] == ["B2.0", "F2.2"]
    assert compute_runs(parse_program("RA1.0<0 SG1.0>0 TIE OPT")) == []


def test_max_gathered_counts_distinct_chunks_held():
    assert max_gathered(parse_program("AG0 AG2 RP0 AG4 RP2 RP4 OPT")) == 2
    assert max_gathered(parse_program("AG0 AG2 AG4 RP0 RP2 AG6 RP4 RP6 OPT")) == 3
    assert max_gathered(parse_program("F0.0 B0.0 OPT")) == 0


@pytest.mark.parametrize("prefetch", [-1, -3])
def test_add_param_gathers_refuses_negative_prefetch(prefetch):
    order = compute_order("1f1b", 2, 1, 2)[0]
    with pytest.raises(ValueError, match=f"prefetch={prefetch} must be >= 0"):
        add_param_gathers(order, prefetch)
    with pytest.raises(ValueError, match=f"prefetch={prefetch} must be >= 0"):
        build_programs("1f1b", 2, 1, 2, dp=2, zero=3, prefetch=prefetch)


# --- the validator names each broken ZeRO rule -----------------------------------------

PP, VPP, M = 2, 2, 4


def _programs(zero, prefetch=0):
    return build_programs("interleaved-1f1b", PP, VPP, M, dp=2, zero=zero, prefetch=prefetch)


def _remove(program, text, last=False):
    action = parse(text)
    indices = [i for i, a in enumerate(program) if a == action]
    del program[indices[-1 if last else 0]]


def _replace_last(program, old, new):
    index = max(i for i, a in enumerate(program) if a == parse(old))
    program[index] = parse(new)


def _move_before(program, text, anchor):
    action = parse(text)
    program.remove(action)
    program.insert(program.index(parse(anchor)), action)


def _insert_before(program, anchor, text):
    program.insert(program.index(parse(anchor)), parse(text))


def _insert_after(program, anchor, text):
    program.insert(program.index(parse(anchor)) + 1, parse(text))


# (zero, how to break rank 0 or 1, rank named, action named, words in the reason)
ZERO_BREAKAGES = [
    (3, lambda p: _remove(p[0], "AG0"), 0, "F0.0",
     "uses chunk 0's parameters, which are not gathered"),
    (3, lambda p: _move_before(p[0], "RP0", "F0.1"), 0, "F0.1",
     "uses chunk 0's parameters, which are not gathered"),
    (3, lambda p: _insert_after(p[0], "AG0", "AG0"), 0, "AG0", "chunk 0 is already gathered"),
    (3, lambda p: p[1].insert(0, parse("RP3")), 1, "RP3", "chunk 3 is not gathered"),
    (3, lambda p: _remove(p[0], "RS0", last=True), 0, "B0.0",
     "chunk 0's gradient is never reduce-scattered after this backward"),
    (3, lambda p: _insert_after(p[1], "RS3", "RS3"), 1, "RS3",
     "no backward of chunk 3 since its last reduction"),
    (3, lambda p: _replace_last(p[0], "RS2", "DP2"), 0, "DP2",
     "ZeRO stage 3 has no REDUCE_GRADS"),
    (3, lambda p: p[0].append(parse("AG0")), 0, "AG0",
     "ZeRO-3 gathers nothing after the optimizer step"),
    (1, lambda p: _replace_last(p[0], "RS0", "DP0"), 0, "DP0",
     "ZeRO stage 1 has no REDUCE_GRADS"),
    (2, lambda p: _move_before(p[1], "AG1", "OPT"), 1, "AG1",
     "ZeRO-2 gathers parameters only after the optimizer step"),
    (1, lambda p: _insert_after(p[0], "OPT", "RS0"), 0, "OPT", "must be the last action"),
    (2, lambda p: _insert_after(p[1], "OPT", "TIE"), 1, "OPT", "must be the last action"),
    (1, lambda p: _move_before(p[0], "RS0", "B0.3"), 0, "B0.3",
     "chunk 0's gradient is never reduce-scattered after this backward"),
    (2, lambda p: _insert_after(p[0], "RS2", "RS2"), 0, "RS2",
     "no backward of chunk 2 since its last reduction"),
    (1, lambda p: _insert_before(p[1], "TIE", "RP1"), 1, "RP1",
     "ZeRO stage 1 has no RELEASE_PARAMS"),
    (0, lambda p: _replace_last(p[0], "DP0", "RS0"), 0, "RS0",
     "ZeRO stage 0 has no REDUCE_SCATTER_GRADS"),
    (0, lambda p: p[1].append(parse("AG1")), 1, "AG1", "ZeRO stage 0 has no GATHER_PARAMS"),
]


@pytest.mark.parametrize("zero, breakage, rank, action, reason", ZERO_BREAKAGES)
def test_validate_names_each_broken_zero_rule(zero, breakage, rank, action, reason):
    programs = _programs(zero)
    validate_programs(programs, PP, VPP, M, zero=zero)  # intact before the break
    breakage(programs)
    with pytest.raises(ProgramError) as caught:
        validate_programs(programs, PP, VPP, M, zero=zero)
    err = caught.value
    assert (err.rank, str(err.action)) == (rank, action)
    assert programs[rank][err.index] == parse(action)
    assert str(err).startswith(f"rank {rank}, action {err.index} ({action}): ")
    assert reason in str(err)


def test_validate_names_a_chunk_left_gathered_at_the_end():
    programs = _programs(3)
    _remove(programs[1], "RP1", last=True)
    with pytest.raises(ProgramError) as caught:
        validate_programs(programs, PP, VPP, M, zero=3)
    assert (caught.value.rank, caught.value.index, caught.value.action) == (1, None, None)
    assert str(caught.value) == "rank 1: chunks [1] are still gathered at the end"


def test_validate_names_a_missing_gather_of_updated_parameters():
    programs = _programs(1)
    _remove(programs[0], "AG2")
    with pytest.raises(ProgramError) as caught:
        validate_programs(programs, PP, VPP, M, zero=1)
    assert str(caught.value) == ("rank 0: ZeRO-1 gathers chunk 2's updated parameters "
                                 "once after the optimizer step")


@pytest.mark.parametrize("built, checked, action, reason", [
    (0, 3, "F0.0", "uses chunk 0's parameters, which are not gathered"),
    (1, 0, "RS2", "ZeRO stage 0 has no REDUCE_SCATTER_GRADS"),
    (3, 1, "AG0", "ZeRO-1 gathers parameters only after the optimizer step"),
    (3, 0, "AG0", "ZeRO stage 0 has no GATHER_PARAMS"),
])
def test_programs_of_one_stage_fail_the_rules_of_another(built, checked, action, reason):
    with pytest.raises(ProgramError) as caught:
        validate_programs(_programs(built), PP, VPP, M, zero=checked)
    assert (caught.value.rank, str(caught.value.action)) == (0, action)
    assert reason in str(caught.value)


