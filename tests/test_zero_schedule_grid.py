"""ZeRO in the step program over a grid of layouts: properties checked with a checker
written here (independent of `zero_rules.check_zero`), and the simulator's gather timing
against bounds derived in the docstrings. No processes."""

from __future__ import annotations

import math

import pytest

from interleaf.coordinator.schedule import (CostModel, build_programs, simulate, validate_programs)
from interleaf.coordinator.schedule.zero import compute_runs, max_gathered
from interleaf.protos.actions import Action
from tests.zero_programs import (AG, B, DP, DPS, LAYOUTS, OPT, RP, RS, SG, STAGES, built,
                                 gathered_peak, kinds, last_backward, owned)

# --- properties over the grid ----------------------------------------------------------

@pytest.mark.parametrize("schedule, pp, vpp, m", LAYOUTS)
def test_every_zero_program_validates_simulates_and_is_deterministic(schedule, pp, vpp, m):
    seen = set()
    cost = CostModel(forward_s=1.0, backward_s=2.0, latency_s=0.1, reduce_s=0.25,
                     gather_s=0.5)
    for dp in DPS:
        for zero, prefetch in STAGES:
            programs = built(schedule, pp, vpp, m, dp, zero, prefetch)
            if dp == 2:
                # Rebuilt from scratch: the same inputs give the same programs, so all
                # DP replicas issue one chunk's collectives in the same order.
                assert build_programs(schedule, pp, vpp, m, dp, zero=zero,
                                      prefetch=prefetch) == [list(p) for p in programs]
            if (zero, programs) in seen:
                continue
            seen.add((zero, programs))
            validate_programs([list(p) for p in programs], pp, vpp, m, zero=zero)
            result = simulate([list(p) for p in programs], cost)  # DeadlockError fails
            assert result.busy_s == pytest.approx([3.0 * m * vpp] * pp)


@pytest.mark.parametrize("schedule, pp, vpp, m", LAYOUTS)
def test_zero0_all_reduces_only_with_data_parallelism(schedule, pp, vpp, m):
    for dp in DPS:
        for rank, program in enumerate(built(schedule, pp, vpp, m, dp, 0, 1)):
            assert not [a for a in program if a.kind in (RS, AG, RP)]
            reduced = sorted(c for _, c in kinds(program, DP))
            assert reduced == (owned(rank, pp, vpp) if dp > 1 else [])
            assert program[-1] == Action(OPT)


@pytest.mark.parametrize("schedule, pp, vpp, m", LAYOUTS)
def test_zero12_one_reduce_scatter_per_chunk_and_gathers_after_the_step(schedule, pp, vpp,
                                                                       m):
    for zero in (1, 2):
        for dp in DPS:
            for rank, program in enumerate(built(schedule, pp, vpp, m, dp, zero, 1)):
                chunks = owned(rank, pp, vpp)
                assert not [a for a in program if a.kind in (DP, RP)]
                scatters = kinds(program, RS)
                assert sorted(c for _, c in scatters) == chunks  # once each, dp=1 too
                for i, chunk in scatters:
                    # Right behind the last backward, but for the send of its input
                    # gradient (alone or in an exchange, after any point-to-point
                    # action that came due during the backward).
                    last = last_backward(program, chunk)
                    between = program[last + 1:i]
                    assert all(a.p2p_ops() for a in between), (rank, program[i], between)
                    assert not between or SG in {op.kind for op in between[-1].p2p_ops()}
                step = program.index(Action(OPT))
                assert list(program[step + 1:]) == [Action(AG, c) for c in chunks]


@pytest.mark.parametrize("schedule, pp, vpp, m", LAYOUTS)
def test_zero3_computes_only_on_gathered_chunks_within_the_prefetch_bound(schedule, pp,
                                                                         vpp, m):
    for dp in DPS:
        gathers_by_prefetch = []
        for prefetch in range(5):
            programs = built(schedule, pp, vpp, m, dp, 3, prefetch)
            for program in programs:
                assert not [a for a in program if a.kind is DP]
                assert program[-1] == Action(OPT)  # ZeRO-3 gathers nothing after it
                peak = gathered_peak(program)
                assert peak == max_gathered(program)
                assert 1 <= peak <= min(prefetch + 1, vpp)
                if prefetch == 0:
                    # Consecutive runs are of different chunks, so none can merge: one
                    # gather and one release per run.
                    runs = len(compute_runs(program))
                    assert len(kinds(program, AG)) == len(kinds(program, RP)) == runs
            gathers_by_prefetch.append([len(kinds(p, AG)) for p in programs])
        # Gathering earlier only merges more runs: never more gathers.
        for fewer, more in zip(gathers_by_prefetch[1:], gathers_by_prefetch):
            assert all(a <= b for a, b in zip(fewer, more)), gathers_by_prefetch


@pytest.mark.parametrize("schedule, pp, vpp, m", LAYOUTS)
def test_zero3_reduce_scatters_each_chunk_once_after_its_last_backward(schedule, pp, vpp, m):
    for prefetch in range(5):
        for program in built(schedule, pp, vpp, m, 2, 3, prefetch):
            pending = {}  # chunk -> first backward not yet covered by an RS
            for i, a in enumerate(program):
                if a.kind is B:
                    pending.setdefault(a.chunk, i)
                elif a.kind is RS:
                    assert a.chunk in pending, f"{i} {a}: no backward since the last RS"
                    del pending[a.chunk]
            assert pending == {}
            # One RS per chunk, right behind its last backward (only that backward's
            # release and point-to-point actions between): as much traffic as plain
            # data parallelism.
            scatters = kinds(program, RS)
            assert len(scatters) == len({a.chunk for a in program if a.kind is B})
            for i, chunk in scatters:
                last = last_backward(program, chunk)
                assert all(a.kind is RP or a.p2p_ops() for a in program[last + 1:i])


# --- simulation ------------------------------------------------------------------------

def _gathers(program):
    return sum(a.kind is AG for a in program)


def test_gathers_and_reductions_are_charged_on_one_rank():
    """One rank (interleaved pp=1, vpp=3, m=2, prefetch 0): nothing to wait for but the
    gathers, so each of the 9 runs waits one full gather_s before its first compute, and
    the 3 chunks' reductions plus the local TIE each cost reduce_s:
        6 F (1 s) + 6 B (2 s) + 9 * 0.5 + 4 * 0.25 = 18 + 4.5 + 1.0 = 23.5 s."""
    (program,) = build_programs("interleaved-1f1b", 1, 3, 2, dp=2, zero=3, prefetch=0)
    assert (_gathers(program), len(kinds(program, RS))) == (9, 3)
    result = simulate([program], CostModel(forward_s=1.0, backward_s=2.0, gather_s=0.5,
                                           reduce_s=0.25))
    assert result.makespan_s == 23.5
    assert result.busy_s == [18.0]


def test_prefetch_overlaps_the_gather_with_compute():
    """Interleaved pp=2, vpp=4, m=8; forward 1 s, backward 2 s, gather g = 0.5 s.

    prefetch 0: a run's AG is issued after the previous run's last compute and its first
    compute waits for it, so every run puts g on its rank's critical path:
        makespan >= max over ranks (busy_r + g * gathers_r);
    rank 0 computes 8 * 4 * (1 + 2) = 96 s in 51 runs, so makespan >= 96 + 25.5 = 121.5
    against 99 s with free gathers (and in fact equals it: rank 0 never waits for a
    message here).
    prefetch >= 1 with g <= min(forward, backward): the gather of run j is issued before
    run j-prefetch, at least one compute (>= g) ahead, so it has landed when run j could
    start; only the gathers issued at time 0 delay anything, and every compute depends
    on F0.0, which waits exactly g:
        makespan == makespan(g=0) + g.
    """
    pp, vpp, m, g = 2, 4, 8, 0.5
    cost = CostModel(forward_s=1.0, backward_s=2.0, gather_s=g)
    free = simulate(build_programs("interleaved-1f1b", pp, vpp, m, dp=2, zero=0),
                    cost).makespan_s
    makespans = []
    for prefetch in range(5):
        programs = build_programs("interleaved-1f1b", pp, vpp, m, dp=2, zero=3,
                                  prefetch=prefetch)
        result = simulate(programs, cost)
        makespans.append(result.makespan_s)
        if prefetch == 0:
            bound = max(b + g * _gathers(p) for b, p in zip(result.busy_s, programs))
            assert (free, result.busy_s[0], _gathers(programs[0])) == (99.0, 96.0, 51)
            assert bound == 121.5
            assert result.makespan_s >= bound
        else:
            assert math.isclose(result.makespan_s, free + g)
    assert makespans[1] < makespans[0]
    assert makespans == sorted(makespans, reverse=True)


@pytest.mark.parametrize("schedule, pp, vpp, m", [("gpipe", 3, 1, 6), ("1f1b", 4, 1, 8),
                                                   ("interleaved-1f1b", 2, 3, 4),
                                                   ("interleaved-1f1b", 4, 2, 8)])
def test_prefetch_hides_every_gather_but_the_first(schedule, pp, vpp, m):
    # The bound of test_prefetch_overlaps_the_gather_with_compute, with link latency.
    g = 1.0
    cost = CostModel(forward_s=1.0, backward_s=2.0, latency_s=0.3, gather_s=g)
    free = simulate(build_programs(schedule, pp, vpp, m, dp=2, zero=0), cost).makespan_s
    for prefetch in (1, 2, 4):
        programs = build_programs(schedule, pp, vpp, m, dp=2, zero=3, prefetch=prefetch)
        assert math.isclose(simulate(programs, cost).makespan_s, free + g)


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_step_ends_when_the_updated_parameters_land(zero):
    # The post-step gathers run concurrently and nothing computes after them.
    cost = CostModel(forward_s=1.0, backward_s=2.0, gather_s=0.75)
    free = simulate(build_programs("interleaved-1f1b", 2, 2, 4, dp=2, zero=0), cost)
    result = simulate(build_programs("interleaved-1f1b", 2, 2, 4, dp=2, zero=zero), cost)
    assert result.makespan_s == free.makespan_s + 0.75


@pytest.mark.parametrize("schedule, pp, vpp, m", LAYOUTS)
def test_free_zero_collectives_change_nothing(schedule, pp, vpp, m):
    # ZeRO adds no compute and no point-to-point: with gathers and reductions free the
    # step takes exactly as long as ZeRO-0's, link costs included.
    cost = CostModel(forward_s=1.0, backward_s=2.0, latency_s=0.25, message_bytes=100,
                     bandwidth_bytes_per_s=1000.0)
    base = simulate([list(p) for p in built(schedule, pp, vpp, m, 2, 0, 1)], cost)
    for zero, prefetch in STAGES[1:]:
        result = simulate([list(p) for p in built(schedule, pp, vpp, m, 2, zero, prefetch)],
                          cost)
        assert (result.makespan_s, result.bubble_fraction, result.busy_s) == \
            (base.makespan_s, base.bubble_fraction, base.busy_s), (zero, prefetch)
