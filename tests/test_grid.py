"""The rank grid, server placement and layer partitioning: pure functions, no processes.

Everything is integer bookkeeping, so every comparison is exact.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from interleaf.coordinator.grid import Coord, RankGrid, place
from interleaf.coordinator.partition import chunks_of, describe, partition

LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 4, 1), (1, 1, 4), (2, 2, 2), (3, 2, 2), (2, 3, 1), (1, 3, 2), (2, 4, 2)]

# --- RankGrid -------------------------------------------------------------------------------


def test_worked_example_from_the_docstring():
    grid = RankGrid(dp=2, pp=2, tp=2)
    assert grid.world_size == 8
    expected = {
        0: (0, 0, 0), 1: (0, 0, 1), 2: (0, 1, 0), 3: (0, 1, 1),
        4: (1, 0, 0), 5: (1, 0, 1), 6: (1, 1, 0), 7: (1, 1, 1),
    }
    for rank, (d, p, t) in expected.items():
        assert grid.coord(rank) == Coord(dp=d, pp=p, tp=t)
        assert grid.rank(Coord(d, p, t)) == rank

    assert grid.groups(5) == {
        "tp/d1/p0": [4, 5],
        "pp/d1/t1": [5, 7],
        "dp/p0/t1": [1, 5],
        "tie/d1/t1": [5, 7],
    }
    families = Counter(name.split("/")[0] for name in grid.all_groups())
    assert families == {"tp": 4, "pp": 4, "dp": 4, "tie": 4}
    assert grid.all_groups()["tp/d1/p1"] == [6, 7]
    assert grid.all_groups()["dp/p1/t0"] == [2, 6]


def _families(grid: RankGrid) -> dict[str, list[list[int]]]:
    families: dict[str, list[list[int]]] = {}
    for name, members in grid.all_groups().items():
        families.setdefault(name.split("/")[0], []).append(members)
    return families


@pytest.mark.parametrize("dp, pp, tp", LAYOUTS)
def test_every_rank_is_in_exactly_one_group_of_each_family(dp, pp, tp):
    grid = RankGrid(dp=dp, pp=pp, tp=tp)
    world = dp * pp * tp
    families = _families(grid)

    for family, size in (("tp", tp), ("pp", pp), ("dp", dp)):
        groups = families[family]
        assert len(groups) == world // size
        assert all(len(g) == size for g in groups)
        assert sorted(r for g in groups for r in g) == list(range(world))

    ends = sorted(r for r in range(world) if grid.coord(r).pp in (0, pp - 1))
    if pp == 1:
        assert "tie" not in families
    else:
        assert len(families["tie"]) == dp * tp
        assert sorted(r for g in families["tie"] for r in g) == ends


@pytest.mark.parametrize("dp, pp, tp", LAYOUTS)
def test_coords_and_groups_follow_the_dp_pp_tp_layout(dp, pp, tp):
    grid = RankGrid(dp=dp, pp=pp, tp=tp)
    for rank in range(grid.world_size):
        c = grid.coord(rank)
        # tp innermost, dp outermost.
        assert rank == (c.dp * pp + c.pp) * tp + c.tp
        assert grid.rank(c) == rank
        groups = grid.groups(rank)
        for name, members in groups.items():
            assert rank in members
            # Every member agrees on the group's name and member order.
            for other in members:
                assert grid.groups(other)[name] == members
        tp_group = groups[f"tp/d{c.dp}/p{c.pp}"]
        assert tp_group == list(range(tp_group[0], tp_group[0] + tp))  # consecutive ranks
        assert [grid.coord(r).pp for r in groups[f"pp/d{c.dp}/t{c.tp}"]] == list(range(pp))
        assert [grid.coord(r).dp for r in groups[f"dp/p{c.pp}/t{c.tp}"]] == list(range(dp))
        tie = groups.get(f"tie/d{c.dp}/t{c.tp}")
        if pp > 1 and c.pp in (0, pp - 1):
            assert [grid.coord(r).pp for r in tie] == [0, pp - 1]
            assert {(grid.coord(r).dp, grid.coord(r).tp) for r in tie} == {(c.dp, c.tp)}
        else:
            assert tie is None


def test_middle_pipeline_stages_have_no_tie_group():
    grid = RankGrid(dp=1, pp=4, tp=1)
    assert [any(n.startswith("tie/") for n in grid.groups(r)) for r in range(4)] == [True, False, False, True]
    assert grid.groups(0)["tie/d0/t0"] == grid.groups(3)["tie/d0/t0"] == [0, 3]


def test_describe_lists_every_rank_and_group():
    grid = RankGrid(dp=2, pp=2, tp=2)
    text = grid.describe()
    assert "   5   1   0   1" in text.splitlines()
    for name, members in grid.all_groups().items():
        assert f"  {name:<12} {members}" in text.splitlines()


# --- place ------------------------------------------------------------------------------------


def _servers(sizes: dict[str, int]) -> list[tuple[str, str]]:
    servers = [(f"{host}-s{i}", host) for host, n in sizes.items() for i in range(n)]
    random.Random(0).shuffle(servers)  # registration order must not matter
    return servers


def _tp_hosts(chosen: list[str], servers: list[tuple[str, str]], tp: int) -> list[set[str]]:
    host_of = dict(servers)
    return [{host_of[s] for s in chosen[i : i + tp]} for i in range(0, len(chosen), tp)]


@pytest.mark.parametrize("sizes, grid", [
    ({"h0": 4, "h1": 4}, RankGrid(dp=2, pp=1, tp=4)),
    ({"h0": 4, "h1": 4}, RankGrid(dp=1, pp=2, tp=4)),
    ({"a": 3, "b": 3, "c": 2}, RankGrid(dp=3, pp=1, tp=2)),
    ({"a": 3, "b": 3, "c": 2}, RankGrid(dp=1, pp=3, tp=2)),
    ({"h0": 5, "h1": 3, "h2": 4}, RankGrid(dp=1, pp=2, tp=4)),
    ({"h0": 8}, RankGrid(dp=2, pp=2, tp=2)),
])
def test_place_keeps_each_tp_group_on_one_host_when_hosts_have_room(sizes, grid):
    servers = _servers(sizes)
    chosen = place(servers, grid)
    assert len(chosen) == grid.world_size
    assert len(set(chosen)) == grid.world_size
    assert set(chosen) <= {sid for sid, _ in servers}
    assert all(len(hosts) == 1 for hosts in _tp_hosts(chosen, servers, grid.tp))
    assert place(sorted(servers), grid) == chosen  # deterministic


def test_place_fills_every_server_and_keeps_as_many_tp_groups_whole_as_fit():
    # 3+3+2 servers, tp=2, world 8: every server is used, and a host of 3 can hold one
    # whole pair, so at most 3 of the 4 pairs can be single-host; place() achieves that.
    servers = _servers({"a": 3, "b": 3, "c": 2})
    grid = RankGrid(dp=4, pp=1, tp=2)
    chosen = place(servers, grid)
    assert sorted(chosen) == sorted(sid for sid, _ in servers)
    hosts = _tp_hosts(chosen, servers, grid.tp)
    assert sum(len(h) == 1 for h in hosts) == 3


def test_place_without_room_for_a_whole_group_still_assigns_distinct_servers():
    servers = _servers({"a": 2, "b": 2, "c": 2, "d": 2})
    chosen = place(servers, RankGrid(dp=2, pp=1, tp=4))
    assert sorted(chosen) == sorted(sid for sid, _ in servers)


def test_place_rejects_too_few_servers():
    with pytest.raises(ValueError, match="8 ranks need as many servers, 7 given"):
        place(_servers({"a": 4, "b": 3}), RankGrid(dp=2, pp=2, tp=2))


# --- partition ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_layers, pp, vpp", [
    (8, 1, 1), (8, 2, 1), (8, 4, 2), (8, 2, 4), (7, 2, 1), (10, 2, 2), (11, 3, 2), (5, 5, 1), (32, 4, 3),
])
def test_partition_is_contiguous_and_round_robin(n_layers, pp, vpp):
    chunks = partition(n_layers, pp, vpp)
    count = pp * vpp
    assert [c.index for c in chunks] == list(range(count))
    assert sum(len(c.layers) for c in chunks) == n_layers
    assert chunks[0].layers.start == 0 and chunks[-1].layers.stop == n_layers
    assert all(a.layers.stop == b.layers.start for a, b in zip(chunks, chunks[1:]))
    assert [c.pipeline_rank for c in chunks] == [c % pp for c in range(count)]
    assert [c.has_embedding for c in chunks] == [True] + [False] * (count - 1)
    assert [c.has_head for c in chunks] == [False] * (count - 1) + [True]
    # Uneven splits give the extra layers to the first chunks.
    sizes = [len(c.layers) for c in chunks]
    base, extra = divmod(n_layers, count)
    assert sizes == [base + 1] * extra + [base] * (count - extra)
    for rank in range(pp):
        assert [c.index for c in chunks_of(chunks, rank)] == list(range(rank, count, pp))


def test_describe_partition_even_and_uneven():
    even = describe(partition(8, 2, 2), pp=2)
    assert even.splitlines() == [
        "pipeline rank 0: chunk 0 [embedding + layers 0-1], chunk 2 [layers 4-5]",
        "pipeline rank 1: chunk 1 [layers 2-3], chunk 3 [layers 6-7 + head]",
    ]
    assert "uneven" not in even

    uneven = describe(partition(7, 2, 1), pp=2)
    assert uneven.splitlines()[:2] == [
        "pipeline rank 0: chunk 0 [embedding + layers 0-3]",
        "pipeline rank 1: chunk 1 [layers 4-6 + head]",
    ]
    assert "uneven split: chunks hold 3-4 layers" in uneven


@pytest.mark.parametrize("n_layers, pp, vpp", [(4, 5, 1), (4, 2, 3), (0, 1, 1), (4, 0, 1)])
def test_partition_rejects_impossible_splits(n_layers, pp, vpp):
    with pytest.raises(ValueError, match=f"cannot split {n_layers} layers into {pp * vpp} non-empty chunks"):
        partition(n_layers, pp, vpp)
