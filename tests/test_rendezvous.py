"""Point-to-point under rendezvous semantics (a send completes only when its peer reaches
the matching receive, as with NCCL on one stream): the exchange action, the simulator's
two link models, the placement that makes every program deadlock-free, the validator
that refuses the rest, and `interleaf schedule --links`. No processes.
"""

from __future__ import annotations

import itertools

import pytest

from interleaf.clients.cli import main
from interleaf.coordinator.config import load_config
from interleaf.coordinator.memory_model import predict_rank
from interleaf.coordinator.schedule import (
    CostModel,
    DeadlockError,
    build_programs,
    compute_order,
    simulate,
    validate_programs,
)
from interleaf.coordinator.schedule.fuse import place_p2p
from interleaf.coordinator.schedule.links import link_of
from interleaf.coordinator.schedule.placement import round_robin
from interleaf.coordinator.schedule.lowering import add_gradient_sync, add_p2p
from interleaf.protos.actions import Action, Kind, format_program, parse, parse_program
from tests.conftest import TINY

SA, RA, SG, RG = Kind.SEND_ACT, Kind.RECV_ACT, Kind.SEND_GRAD, Kind.RECV_GRAD
X = Kind.EXCHANGE


def _old_placement(schedule, pp, vpp, m, dp=1):
    """The programs as lowered before exchanges existed: each receive right before its
    consumer, each send right after its producer."""
    programs = add_p2p(compute_order(schedule, pp, vpp, m), round_robin(pp, vpp))
    return [add_gradient_sync(p, r, round_robin(pp, vpp), dp, tied_embedding_pipeline=True)
            for r, p in enumerate(programs)]


# --- the exchange action ----------------------------------------------------------------

def test_exchange_round_trips_through_its_string():
    x = Action(X, members=(Action(SA, 0, 1, 1), Action(RG, 0, 0, 1)))
    assert str(x) == "SA0.1>1+RG0.0<1"
    assert parse("SA0.1>1+RG0.0<1") == x
    four = "SA1.2>0+SG1.0>0+RA1.3<0+RG1.1<0"
    assert str(parse(four)) == four and len(parse(four).members) == 4
    assert parse_program(f"F0.0 {four} OPT")[1].p2p_ops() == parse(four).members
    assert parse("SA0.1>1").p2p_ops() == (parse("SA0.1>1"),)
    assert parse("F0.1").p2p_ops() == ()


@pytest.mark.parametrize("text, words", [
    ("SA0.1>1+F0.1", "two or more sends and receives"),
    ("SA0.1>1+SA0.1>1", "posts each operation once"),
    ("SA0.1>1+", "not an action: ''"),
    ("X", "not an action"),
    ("SA0.1>1+RG0.0<01", "malformed action"),
])
def test_malformed_exchanges_are_refused(text, words):
    with pytest.raises(ValueError, match=words):
        parse(text)


def test_an_exchange_needs_two_members_and_only_it_has_members():
    with pytest.raises(ValueError, match="two or more"):
        Action(X, members=(Action(SA, 0, 1, 1),))
    with pytest.raises(ValueError, match="only an exchange has members"):
        Action(SA, 0, 1, 1, members=(Action(RG, 0, 0, 1),))


# --- the simulator's link semantics on hand-written programs ---------------------------

def test_two_ranks_that_send_before_they_receive_deadlock_only_under_rendezvous():
    programs = [parse_program("F0.0 SA0.0>1 RG0.9<1"), parse_program("F1.9 SG1.9>0 RA1.0<0")]
    eager = simulate(programs, CostModel(), links="eager")
    assert eager.makespan_s == 1.0
    with pytest.raises(DeadlockError) as caught:
        simulate(programs, CostModel())
    assert str(caught.value) == (
        "deadlock: rank 0 waits at action 1 (SA0.0>1) for RA1.0<0 on rank 1; "
        "rank 1 waits at action 1 (SG1.9>0) for RG0.9<1 on rank 0")
    assert [(b.rank, b.index, str(b.action), [str(op) for op in b.waiting_for])
            for b in caught.value.blocked] == [(0, 1, "SA0.0>1", ["SA0.0>1"]),
                                               (1, 1, "SG1.9>0", ["SG1.9>0"])]


def test_fused_into_exchanges_the_same_ranks_meet_and_pay_one_transfer():
    # Rank 1 reaches its exchange 2 s after rank 0 (a backward costs 2): both complete
    # when the later one is posted plus one transfer, 2 + 0.25.
    programs = [parse_program("F0.0 SA0.0>1+RG0.9<1 F0.1"),
                parse_program("B1.9 SG1.9>0+RA1.0<0 F1.0")]
    result = simulate(programs, CostModel(latency_s=0.25))
    spans = [[(str(s.action), s.start, s.end) for s in rank] for rank in result.timeline]
    assert spans == [[("F0.0", 0, 1), ("SA0.0>1+RG0.9<1", 1, 2.25), ("F0.1", 2.25, 3.25)],
                     [("B1.9", 0, 2), ("SG1.9>0+RA1.0<0", 2, 2.25), ("F1.0", 2.25, 3.25)]]


def test_a_send_holds_its_sender_until_the_receiver_is_there():
    programs = [parse_program("F0.0 SA0.0>1 F0.1"), parse_program("F1.8 F1.9 RA1.0<0 F1.0")]
    rendezvous = simulate(programs, CostModel(latency_s=0.5))
    eager = simulate(programs, CostModel(latency_s=0.5), links="eager")
    # Rendezvous: the send waits from 1 until rank 1 posts its receive at 2, then 0.5 on
    # the wire. Eager: rank 0 goes on at once; the message lands at 1.5, before rank 1
    # wants it at 2.
    assert [s.end for s in rendezvous.timeline[0]] == [1.0, 2.5, 3.5]
    assert [s.end for s in eager.timeline[0]] == [1.0, 1.0, 2.0]
    # And rank 1's receive, posted at 2, completes only after the transfer that starts then.
    assert rendezvous.timeline[1][-1].end == eager.timeline[1][-1].end + 0.5 == 3.5


def test_an_exchange_member_completes_once_its_partner_is_posted():
    # NCCL group semantics: rank 0's send needs only rank 1's exchange to be posted, not
    # complete; rank 1's exchange as a whole waits for rank 2, which computes first.
    programs = [parse_program("SA0.0>1 F0.1"), parse_program("SA1.0>2+RA1.0<0 F1.0"),
                parse_program("F2.9 RA2.0<1 F2.0")]
    result = simulate(programs, CostModel())
    assert [[s.end for s in rank] for rank in result.timeline] == \
        [[0.0, 1.0], [1.0, 2.0], [1.0, 1.0, 2.0]]


def test_a_receive_whose_send_never_comes_is_named():
    programs = [parse_program("F0.0"), parse_program("B1.9 SG1.9>0+RA1.0<0")]
    with pytest.raises(DeadlockError, match=r"^deadlock: rank 1 waits at action 1 "
                                            r"\(SG1.9>0\+RA1.0<0\) for RG0.9<1 on rank 0, "
                                            r"SA0.0>1 on rank 0$"):
        simulate(programs, CostModel())


def test_links_must_be_known():
    with pytest.raises(ValueError, match="links='lazy' must be one of rendezvous, eager"):
        simulate([[]], CostModel(), links="lazy")


# --- the old placement deadlocks, the new one does not ----------------------------------

def test_old_placement_of_1f1b_deadlocks_as_the_issue_reports():
    """1F1B pp=2 m=4, receive-before-consumer and send-after-producer: rank 0 sends
    microbatch 1's activation before it receives microbatch 0's gradient, rank 1 sends
    that gradient before it receives the activation. Eager links hide it."""
    programs = _old_placement("1f1b", 2, 1, 4)
    assert format_program(programs[0]).startswith("F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0")
    assert format_program(programs[1]).startswith("RA1.0<0 F1.0 B1.0 SG1.0>0 RA1.1<0 F1.1")
    simulate(programs, CostModel(), links="eager")
    with pytest.raises(DeadlockError) as caught:
        validate_programs(programs, 2, 1, 4)
    assert str(caught.value) == (
        "deadlock: rank 0 waits at action 3 (SA0.1>1) for RA1.1<0 on rank 1; "
        "rank 1 waits at action 3 (SG1.0>0) for RG0.0<1 on rank 0")


@pytest.mark.parametrize("schedule, pp, vpp, m", [("1f1b", 4, 1, 8),
                                                   ("interleaved-1f1b", 2, 2, 4),
                                                   ("interleaved-1f1b", 4, 3, 8)])
def test_old_placement_deadlocks_every_pipelined_schedule(schedule, pp, vpp, m):
    with pytest.raises(DeadlockError, match="waits at action"):
        simulate(_old_placement(schedule, pp, vpp, m), CostModel())
    validate_programs(build_programs(schedule, pp, vpp, m, dp=1), pp, vpp, m)


def test_old_placement_of_gpipe_was_already_safe():
    # All forwards, then all backwards: no rank ever sends while its peer sends to it.
    simulate(_old_placement("gpipe", 4, 1, 8), CostModel())


def test_the_worked_example_of_fuse():
    programs = build_programs("1f1b", 2, 1, 4, dp=1)
    assert format_program(programs[0]).startswith(
        "F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 F0.2 SA0.2>1+RG0.1<1 B0.1 ")
    assert format_program(programs[1]).startswith(
        "RA1.0<0 F1.0 RA1.1<0 B1.0 SG1.0>0 F1.1 B1.1 SG1.1>0+RA1.2<0 F1.2 ")


def test_interleaved_pairs_communicate_once_per_forward_backward_pair():
    # Megatron's send_forward_backward_recv_forward_backward: after the pair F0.3 B2.1,
    # rank 0 sends both outputs and receives both of its next inputs in one exchange.
    program = build_programs("interleaved-1f1b", 2, 2, 4, dp=1)[0]
    text = format_program(program)
    assert "F0.3 B2.1 SA0.3>1+SG2.1>1+RA2.2<1+RG0.0<1 F2.2 B0.0 " in text


def test_place_p2p_refuses_anything_but_add_p2p_programs():
    with pytest.raises(ValueError, match="expects add_p2p's programs; rank 0 has OPT"):
        place_p2p([[Action(Kind.FORWARD, 0, 0), Action(Kind.OPTIMIZER_STEP)]])


# --- every shipped program is deadlock-free ---------------------------------------------

def _grid():
    """(schedule, pp, vpp, microbatches): pp 1-8, vpp 1-4, microbatches from fewer than
    pp to 3*pp (interleaving needs multiples of pp)."""
    for pp in (1, 2, 3, 4, 5, 8):
        for m in sorted({1, max(1, pp - 1), pp, pp + 1, 2 * pp, 3 * pp}):
            yield "gpipe", pp, 1, m
            yield "1f1b", pp, 1, m
            for vpp in (2, 3, 4):
                if m % pp == 0:
                    yield "interleaved-1f1b", pp, vpp, m


GRID = list(_grid())
# (dp, zero, prefetch): which collectives join the point-to-point actions, and where.
SYNCS = [(1, 0, 1), (2, 0, 1), (2, 1, 1), (4, 2, 1), (2, 3, 0), (4, 3, 1), (2, 3, 3)]


def _tick_order_holds(programs):
    """The invariant fuse.py's proof rests on, checked apart from the simulator: merge
    every send with its receive into one node; a rank's point-to-point actions, in
    program order, must then be ordered acyclically and no node may hold two actions
    of one rank."""
    owner: dict = {}  # (rank, index) -> node
    parent: dict = {}

    def find(n):
        while parent.setdefault(n, n) != n:
            n = parent[n]
        return n

    ends: dict = {}
    for rank, program in enumerate(programs):
        for i, action in enumerate(program):
            for op in action.p2p_ops():
                other = ends.setdefault(link_of(rank, op), (rank, i))
                parent[find((rank, i))] = find(other)
    for rank, program in enumerate(programs):
        for i, action in enumerate(program):
            if action.p2p_ops():
                owner[(rank, i)] = find((rank, i))
    members: dict = {}
    for (rank, _), node in owner.items():
        assert rank not in members.setdefault(node, set()), "two actions of a rank at one tick"
        members[node].add(rank)
    edges: dict = {node: set() for node in members}
    for rank, program in enumerate(programs):
        chain = [owner[(rank, i)] for i in range(len(program)) if (rank, i) in owner]
        for a, b in itertools.pairwise(chain):
            edges[a].add(b)
    incoming = {node: 0 for node in edges}
    for targets in edges.values():
        for b in targets:
            incoming[b] += 1
    ready = [n for n, k in incoming.items() if k == 0]
    seen = 0
    while ready:
        n = ready.pop()
        seen += 1
        for b in edges[n]:
            incoming[b] -= 1
            if incoming[b] == 0:
                ready.append(b)
    return seen == len(edges)


@pytest.mark.parametrize("schedule, pp, vpp, m", GRID)
def test_every_program_is_deadlock_free_under_rendezvous(schedule, pp, vpp, m):
    for dp, zero, prefetch in SYNCS:
        programs = build_programs(schedule, pp, vpp, m, dp, zero=zero, prefetch=prefetch)
        validate_programs(programs, pp, vpp, m, zero=zero)  # runs them under rendezvous
        result = simulate(programs, CostModel(forward_s=1.0, backward_s=2.0, latency_s=0.1,
                                              reduce_s=0.2, gather_s=0.3))
        assert result.busy_s == pytest.approx([3.0 * vpp * m] * pp)
        assert _tick_order_holds(programs)
    for program in programs:
        for action in program:
            if action.kind is X:
                # A step's outputs (two for a forward-backward pair) and, from each
                # neighbour, what its step ending at this tick sends this way.
                sends = [op for op in action.members if op.kind in (SA, SG)]
                assert len(sends) <= 2 and len(action.members) <= 4


def test_the_invariant_check_can_fail():
    assert not _tick_order_holds(_old_placement("1f1b", 2, 1, 4))


@pytest.mark.parametrize("schedule, pp, vpp, m", [("gpipe", 4, 1, 8), ("1f1b", 4, 1, 8),
                                                   ("interleaved-1f1b", 4, 2, 8),
                                                   ("interleaved-1f1b", 3, 3, 6)])
def test_rendezvous_keeps_the_closed_form_bubble_where_eager_has_it(schedule, pp, vpp, m):
    # Free links and backward = 1 or 2 forwards: the ranks meet at each tick without
    # waiting, so the bubble is the compute order's, (p-1)/(v*m+p-1).
    for backward_s in (1.0, 2.0):
        cost = CostModel(forward_s=1.0 / vpp, backward_s=backward_s / vpp)
        programs = build_programs(schedule, pp, vpp, m, dp=2)
        rendezvous = simulate(programs, cost).bubble_fraction
        assert rendezvous == pytest.approx(simulate(programs, cost, links="eager").bubble_fraction)
        assert rendezvous == pytest.approx((pp - 1) / (vpp * m + pp - 1))


@pytest.mark.parametrize("backward_s", [1.0, 2.0, 3.0])
def test_rendezvous_loses_no_time_against_eager_links(backward_s):
    # Free links: only waits for a partner can make rendezvous slower. The placement's
    # ticks assume backward = 2 forwards; the ranks still meet without waiting at other
    # ratios, but for interleaved pp=5 (fuse.py).
    for schedule, pp, vpp, m in GRID:
        programs = build_programs(schedule, pp, vpp, m, dp=1)
        cost = CostModel(forward_s=1.0, backward_s=backward_s)
        rendezvous = simulate(programs, cost).makespan_s
        eager = simulate(programs, cost, links="eager").makespan_s
        if (schedule, pp) == ("interleaved-1f1b", 5):
            assert eager <= rendezvous <= 1.03 * eager
        else:
            assert rendezvous == pytest.approx(eager), (schedule, pp, vpp, m)


def test_rendezvous_charges_the_sender_for_the_transfer():
    """GPipe pp=2 m=2, forward 1, backward 2, transfer 0.5. Eager: 1 + 0.5 + 1 + 1 + 2
    + 2 + 0.5 + 2 = 10 (rank 1's F1.0 waits for the first message; rank 0's backwards
    wait for B1.0's gradient to land). Rendezvous: every send and receive also holds its
    rank until its partner is posted and the transfer is done:
        rank 0: F0.0 0-1, SA0.0 1-1.5, F0.1 1.5-2.5, SA0.1 2.5-3, RG0.0 3-6.5,
                B0.0 6.5-8.5, RG0.1 8.5-9, B0.1 9-11;
        rank 1: RA1.0 0-1.5, F1.0 1.5-2.5, RA1.1 2.5-3, F1.1 3-4, B1.0 4-6, SG1.0 6-6.5,
                B1.1 6.5-8.5, SG1.1 8.5-9."""
    programs = build_programs("gpipe", 2, 1, 2, dp=1)
    cost = CostModel(forward_s=1.0, backward_s=2.0, latency_s=0.5)
    assert simulate(programs, cost, links="eager").makespan_s == 10.0
    result = simulate(programs, cost)
    assert result.makespan_s == 11.0
    assert [(str(s.action), s.start, s.end) for s in result.timeline[0]
            if s.action.kind is not Kind.REDUCE_TIED_GRADS][:8] == [
        ("F0.0", 0, 1), ("SA0.0>1", 1, 1.5), ("F0.1", 1.5, 2.5), ("SA0.1>1", 2.5, 3),
        ("RG0.0<1", 3, 6.5), ("B0.0", 6.5, 8.5), ("RG0.1<1", 8.5, 9), ("B0.1", 9, 11)]


# --- memory ---------------------------------------------------------------------------

def test_memory_model_holds_an_exchanges_sends_while_its_receives_are_counted():
    # As the executor posts a batch: the gradient it sends and the activation it
    # receives are both held; sent one after the other, never at once.
    config = load_config("", TINY + ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"])
    hidden = predict_rank(config, parse_program("RA1.1<0"), 1)["communication_peak_bytes"]
    fused = predict_rank(config, parse_program("SG1.0>0+RA1.1<0"), 1)
    split = predict_rank(config, parse_program("SG1.0>0 RA1.1<0"), 1)
    assert hidden > 0
    assert fused["communication_peak_bytes"] == 2 * hidden
    assert split["communication_peak_bytes"] == hidden


# --- the command line ------------------------------------------------------------------

def _schedule(*sets, links="rendezvous"):
    args = [a for o in TINY + list(sets) for a in ("--set", o)]
    return main(["schedule", *args, "--links", links])


LAYOUT = ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]


def test_schedule_links_rendezvous_says_deadlock_free(capsys):
    assert _schedule(*LAYOUT) == 0
    out = capsys.readouterr().out
    assert out.rstrip().endswith(": deadlock-free")
    assert "links rendezvous (a send completes only when its peer reaches the matching " \
           "receive): deadlock-free" in out
    assert "rank 0  F0.0 SA0.0>1 F0.1 SA0.1>1 RG0.0<1 B0.0 F0.2 SA0.2>1+RG0.1<1" in out
    assert "predicted memory per rank" in out and "bubble fraction 0.2000" in out


def test_schedule_links_eager_simulates_without_waiting_senders(capsys):
    assert _schedule(*LAYOUT, links="eager") == 0
    assert "links eager (sends buffered without limit" in capsys.readouterr().out


def test_schedule_links_rendezvous_names_the_blocked_ranks(capsys, monkeypatch):
    # As if the coordinator still lowered with the old placement.
    monkeypatch.setattr("interleaf.coordinator.plan.build_programs",
                        lambda schedule, pp, vpp, m, dp, zero, prefetch, tied:
                        _old_placement(schedule, pp, vpp, m, dp))
    assert _schedule(*LAYOUT) == 1
    assert capsys.readouterr().out == (
        "links rendezvous (a send completes only when its peer reaches the matching "
        "receive): deadlock\n"
        "  rank 0 waits at action 3 (SA0.1>1) for RA1.1<0 on rank 1\n"
        "  rank 1 waits at action 3 (SG1.0>0) for RG0.0<1 on rank 0\n")
