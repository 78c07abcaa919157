"""The rank grid: every rank's (dp, pp, tp) coordinate and every group, sliced from one
tensor `arange(world).view(dp, pp, tp)` (tp innermost, so a tensor-parallel group is a
run of consecutive ranks and can be placed on one host).

Worked example, dp=2, pp=2, tp=2 (8 ranks):

    grid[d, p, t]     d=0: [[0, 1],    d=1: [[4, 5],
                            [2, 3]]          [6, 7]]

    rank 5 -> (dp=1, pp=0, tp=1)
    tp group of 5: grid[1, 0, :] = [4, 5]
    pp group of 5: grid[1, :, 1] = [5, 7]      (pipeline neighbours)
    dp group of 5: grid[:, 0, 1] = [1, 5]      (gradient reduction)
    tie group of 5: [5, 7]  (first and last pipeline stage share the embedding)

The tie group joins the pipeline ranks of the first and the last chunk
(`tie_pipeline_ranks`, from the schedule's placement); where one rank holds both, as
zbv's V puts them on rank 0, there is none: that rank sums the two copies itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch


@dataclass(frozen=True)
class Coord:
    dp: int
    pp: int
    tp: int


@dataclass(frozen=True)
class RankGrid:
    dp: int
    pp: int
    tp: int
    tie_pipeline_ranks: tuple[int, int] | None = None
    """The pipeline ranks of the first and last chunk; None: 0 and pp-1 (round-robin)."""

    @cached_property
    def grid(self) -> torch.Tensor:
        return torch.arange(self.world_size).view(self.dp, self.pp, self.tp)

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp

    def coord(self, rank: int) -> Coord:
        d, p, t = (int(i) for i in (self.grid == rank).nonzero()[0])
        return Coord(d, p, t)

    def rank(self, coord: Coord) -> int:
        return int(self.grid[coord.dp, coord.pp, coord.tp])

    def groups(self, rank: int) -> dict[str, list[int]]:
        """The groups `rank` belongs to, by unique name, members in group-rank order.

        Names are the same on every member, so they double as rendezvous prefixes.
        """
        c = self.coord(rank)
        g = self.grid
        groups = {
            f"tp/d{c.dp}/p{c.pp}": g[c.dp, c.pp, :].tolist(),
            f"pp/d{c.dp}/t{c.tp}": g[c.dp, :, c.tp].tolist(),
            f"dp/p{c.pp}/t{c.tp}": g[:, c.pp, c.tp].tolist(),
        }
        first, last = self.tie_pipeline_ranks or (0, self.pp - 1)
        if first != last and c.pp in (first, last):
            groups[f"tie/d{c.dp}/t{c.tp}"] = [int(g[c.dp, first, c.tp]), int(g[c.dp, last, c.tp])]
        return groups

    def all_groups(self) -> dict[str, list[int]]:
        merged: dict[str, list[int]] = {}
        for rank in range(self.world_size):
            merged.update(self.groups(rank))
        return dict(sorted(merged.items()))

    def describe(self) -> str:
        lines = ["rank  dp  pp  tp"]
        for rank in range(self.world_size):
            c = self.coord(rank)
            lines.append(f"{rank:>4} {c.dp:>3} {c.pp:>3} {c.tp:>3}")
        lines.append("groups:")
        lines += [f"  {name:<12} {members}" for name, members in self.all_groups().items()]
        return "\n".join(lines)


def place(servers: list[tuple[str, str]], grid: RankGrid) -> list[str]:
    """Chooses a server for every rank: returns server ids indexed by rank.

    `servers` are (server_id, host) pairs, at least world_size of them. Tensor-parallel
    groups talk every layer, so each is kept on one host where a host has room for a
    whole group; hosts with the most free servers are filled first.
    """
    if len(servers) < grid.world_size:
        raise ValueError(f"{grid.world_size} ranks need as many servers, {len(servers)} given")
    by_host: dict[str, list[str]] = {}
    for server_id, host in sorted(servers, key=lambda s: (s[1], s[0])):
        by_host.setdefault(host, []).append(server_id)
    groups_needed = grid.world_size // grid.tp
    chosen: list[str] = []
    # Whole TP groups first, from the roomiest host, then fill the rest anywhere.
    while groups_needed and any(len(ids) >= grid.tp for ids in by_host.values()):
        host = max(by_host, key=lambda h: (len(by_host[h]), h))
        chosen += by_host[host][: grid.tp]
        by_host[host] = by_host[host][grid.tp :]
        groups_needed -= 1
    leftovers = [sid for ids in by_host.values() for sid in ids]
    chosen += leftovers[: grid.world_size - len(chosen)]
    return chosen
