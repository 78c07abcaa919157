"""Broken programs are caught, and the error names the rank and the action.

Each case starts from a valid lowered program (1F1B or interleaved, pp=2) and breaks
one rule; validate_programs must name where, and simulate must name every rank a
deadlock leaves waiting.
"""

from __future__ import annotations

import pytest

from interleaf.coordinator.schedule import (CostModel, DeadlockError, ProgramError, build_programs,
                                  simulate, validate_programs)
from interleaf.protos.actions import Action, Kind, parse, parse_program

PP, VPP, M = 2, 2, 4


def _programs():
    return build_programs("interleaved-1f1b", PP, VPP, M, dp=2)


def _holder(program, op):
    """Index of the action that is `op` or the exchange that holds it."""
    return next(i for i, a in enumerate(program) if op in a.p2p_ops() or a == op)


def _replace(program, old, new):
    i = _holder(program, parse(old))
    members = tuple(parse(new) if m == parse(old) else m for m in program[i].members)
    program[i] = Action(Kind.EXCHANGE, members=members) if members else parse(new)


def _remove(program, text):
    op = parse(text)
    i = _holder(program, op)
    rest = [m for m in program[i].members if m != op]
    program[i:i + 1] = [] if not rest else rest if len(rest) == 1 else \
        [Action(Kind.EXCHANGE, members=tuple(rest))]


def _move_before(program, text, anchor):
    _remove(program, text)
    program.insert(program.index(parse(anchor)), parse(text))


# (how to break rank 0 or 1, rank named, action named, words in the reason)
BREAKAGES = [
    (lambda p: _replace(p[0], "F2.1", "F1.1"), 0, "F1.1", "does not live on rank 0"),
    (lambda p: _replace(p[1], "SA1.0>0", "SA1.0>1"), 1, "SA1.0>1+RA1.1<0",
     "SA1.0>1: peer should be rank 0"),
    (lambda p: _replace(p[1], "RA1.1<0", "RA1.1<1"), 1, "SA1.0>0+RA1.1<1",
     "RA1.1<1: peer should be rank 0"),
    (lambda p: _remove(p[0], "SA0.1>1"), 1, "SA1.0>0+RA1.1<0",
     "RA1.1<0: unmatched: no send on rank 0"),
    (lambda p: _move_before(p[0], "B0.0", "F0.0"), 0, "B0.0", "backward before F0.0"),
    (lambda p: p[0].insert(1, parse("F0.0")), 0, "F0.0", "repeats action 0"),
    (lambda p: _remove(p[1], "SG1.3>0"), 0, "RG0.3<1", "unmatched: no send on rank 1"),
    (lambda p: _remove(p[0], "RG2.1<1"), 0, "B2.1", "its output gradient is not received before it"),
    (lambda p: _move_before(p[1], "RA3.2<0", "B3.2"), 1, "F3.2",
     "its input activation is not received before it"),
    (lambda p: _move_before(p[0], "SA0.1>1", "F0.1"), 0, "SA0.1>1",
     "sent before F0.1 produces it"),
    (lambda p: _move_before(p[0], "DP0", "B0.3"), 0, "DP0", "chunk 0 still has backwards"),
    (lambda p: p[1].insert(-1, parse("DP1")), 1, "DP1", "chunk 1 was reduced at action"),
    (lambda p: _move_before(p[1], "OPT", "TIE"), 1, "OPT", "must be the last action"),
]


@pytest.mark.parametrize("breakage, rank, action, reason", BREAKAGES)
def test_validate_names_rank_action_and_rule(breakage, rank, action, reason):
    programs = _programs()
    validate_programs(programs, PP, VPP, M)  # intact before the break
    breakage(programs)
    with pytest.raises(ProgramError) as caught:
        validate_programs(programs, PP, VPP, M)
    err = caught.value
    assert (err.rank, str(err.action)) == (rank, action)
    assert programs[rank][err.index] == parse(action)
    assert str(err).startswith(f"rank {rank}, action {err.index} ({action}): ")
    assert reason in str(err)


def test_validate_names_a_missing_backward():
    programs = _programs()
    programs[1].remove(parse("B3.3"))
    with pytest.raises(ProgramError) as caught:
        validate_programs(programs, PP, VPP, M)
    assert (caught.value.rank, caught.value.index) == (1, None)
    assert str(caught.value) == "rank 1: program lacks B3.3"


def test_tie_on_a_middle_rank_is_refused():
    programs = build_programs("1f1b", 3, 1, 3, dp=1)
    programs[1].insert(-1, Action(Kind.REDUCE_TIED_GRADS))
    with pytest.raises(ProgramError, match=r"rank 1, action \d+ \(TIE\): only the ranks of the first"):
        validate_programs(programs, 3, 1, 3)


def test_simulate_takes_the_tie_group_from_the_programs():
    # The ranks whose programs sum the tied embedding wait for each other; a rank of
    # its own (zbv's V puts both copies on rank 0) sums locally.
    programs = build_programs("zbv", 2, 2, 2, dp=1)
    assert [any(a.kind is Kind.REDUCE_TIED_GRADS for a in p) for p in programs] == [True, False]
    simulate(programs, CostModel())


def test_dropped_send_deadlocks_the_receiver():
    programs = _programs()
    programs[0].remove(parse("SA2.1>1"))
    with pytest.raises(DeadlockError) as caught:
        simulate(programs, CostModel())
    index = programs[1].index(parse("RA3.1<0"))
    assert f"rank 1 waits at action {index} (RA3.1<0)" in str(caught.value)


def test_receives_waiting_on_each_other_across_ranks_deadlock():
    # Rank 0 waits for microbatch 0's gradient before sending microbatch 0's activation,
    # which rank 1 needs before it can produce that gradient. Statically every receive
    # still precedes its consumer, so only the simulation, which the validator runs
    # last, can see the cycle (with either link semantics).
    programs = [
        parse_program("RG0.0<1 F0.0 SA0.0>1 B0.0 TIE OPT"),
        parse_program("RA1.0<0 F1.0 B1.0 SG1.0>0 TIE OPT"),
    ]
    with pytest.raises(DeadlockError) as caught:
        validate_programs(programs, 2, 1, 1)
    with pytest.raises(DeadlockError, match="rank 1 waits at action 0"):
        simulate(programs, CostModel(), links="eager")
    assert str(caught.value) == ("deadlock: rank 0 waits at action 0 (RG0.0<1) for "
                                 "SG1.0>0 on rank 1; rank 1 waits at action 0 (RA1.0<0) "
                                 "for SA0.0>1 on rank 0")


def test_tie_without_its_partner_is_refused():
    programs = build_programs("1f1b", 2, 1, 2, dp=1)
    programs[1].remove(Action(Kind.REDUCE_TIED_GRADS))
    with pytest.raises(ProgramError, match=r"summed on ranks \[0\], but its copies live on ranks \[0, 1\]"):
        validate_programs(programs, 2, 1, 2)


def test_receives_posted_out_of_the_senders_order_are_refused():
    # NCCL matches point-to-point messages by order, not tag: rank 0 sends chunk 2's
    # microbatch-1 activation before chunk 0's microbatch-2 one, so rank 1 must receive
    # them in that order, or two same-sized tensors would arrive swapped.
    programs = _programs()
    first, second = programs[1].index(parse("RA3.1<0")), programs[1].index(parse("RA1.2<0"))
    programs[1][first], programs[1][second] = programs[1][second], programs[1][first]
    with pytest.raises(ProgramError) as caught:
        validate_programs(programs, PP, VPP, M)
    assert (caught.value.rank, caught.value.index, str(caught.value.action)) == (1, first, "RA1.2<0")
    assert str(caught.value).endswith("receives from rank 0 out of order: message 3 from it is "
                                      "('act', 3, 1), not ('act', 1, 2)")
