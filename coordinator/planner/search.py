"""The planner's search: every candidate layout (candidates.py), pruned by the memory
model, ranked by the simulator running its programs at the measured costs (costs.py).

Branch and bound: a rank computes its forwards, backwards and update one after
another, and cannot start before the first microbatch has passed the chunks ahead of
it, so that is a lower bound on the step the simulator predicts (compute_bound).
Candidates are visited from the lowest bound up; once a bound comes within TOLERANCE
(1%) of the K-th best simulated step, no later candidate can enter the top K by more
than the cost model can tell, and the search stops. What it skips is counted, never
silently lost: the report says how many candidates the rules refused, how many the
memory model did, how many were simulated, and how many a fitting variant matched.

Worked example (tests/test_planner.py, test_search_finds_the_brute_force_best): an
8-layer model on 4 servers has a few hundred candidate layouts; visited by bound, fewer
than a quarter are simulated, and the best found is the best of simulating them all.
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass, field

from interleaf.coordinator.admission import RUNTIME_RESERVE_BYTES
from interleaf.coordinator.config import ConfigError, JobConfig
from interleaf.coordinator.memory_model import predict, with_temporaries
from interleaf.coordinator.schedule import CostModel, SimResult, build_programs, simulate
from interleaf.coordinator.schedule.placement import chunk_ranks
from interleaf.protos.actions import COMPUTE, Action, Kind

from .candidates import RECOMPUTE_ORDER, Layout, checked, layouts, valid_configs
from .costs import DeviceProfile, LayoutCosts, head_layers, layout_costs
from .explain import Outcome, explain, variant_lines

TOLERANCE = 0.01
"""A candidate whose compute alone is within this share of the K-th best predicted step
is not simulated: the cost model's own error is larger (bench/planner.py)."""
VARIANT_TIE = 0.001
"""Variants of one shape (ZeRO stage, recompute, sequence parallelism) predicted within
this share of the shape's fastest are as fast: the one holding least is ranked, then the
lowest ZeRO stage and the least recompute, not the one a rounding favours."""
LINKS = "eager"
"""The executor never waits for its sends (coordinator/executed_step.py's prediction)."""


@dataclass(frozen=True)
class Cluster:
    servers: int
    memory_bytes: int
    """What each server offers (the least of the servers', where they differ)."""
    servers_per_host: int = 8
    compute_slowdown: float = 1.0
    """How much slower a server computes when its host's servers all compute at once
    (more threads than cores: local servers on a small machine)."""
    device_type: str = "cpu"
    """What the servers compute on, "cpu" or "cuda": whether train.compile="auto"
    compiles their blocks, which then keep less for the backward (the memory model)."""
    host_sizes: tuple[int, ...] = ()
    """The servers on each host, where known (a coordinator's, which may differ); empty:
    hosts of servers_per_host, the last holding the rest. Tensor groups must fit them."""


@dataclass(frozen=True)
class RankedPlan:
    layout: Layout
    config: JobConfig
    step_s: float
    bubble: float
    peak_bytes: list[int]
    """Per pipeline rank, the memory model's peak with the loss's forward temporaries
    (memory_model.with_temporaries)."""
    costs: LayoutCosts
    lower_bound_s: float
    why_variants: tuple[str, ...] = ()
    """How its ZeRO stage, recompute and sequence parallelism fared against the same
    layout with another (explain.variant_lines)."""

    @property
    def admission_bytes(self) -> int:
        return max(self.peak_bytes) + RUNTIME_RESERVE_BYTES

    def as_json(self) -> dict:
        # recompute_layers as planned: the config's where the plan chose selective
        train = {**self.layout.train(), "recompute_layers": self.config.train.recompute_layers}
        return {"parallel": self.layout.parallel(), "train": train,
                "predicted_step_seconds": self.step_s, "predicted_bubble": self.bubble,
                "predicted_peak_bytes": max(self.peak_bytes), "predicted_admission_bytes": self.admission_bytes,
                "peak_bytes_per_pipeline_rank": self.peak_bytes, "describe": self.layout.describe(),
                "why": explain(self)}


@dataclass
class SearchReport:
    plans: list[RankedPlan]
    candidates: int = 0
    refused_by_rules: int = 0
    refused_by_memory: int = 0
    simulated: int = 0
    dominated: int = 0
    """Not simulated: the same layout with less recompute fitted."""
    bounded_out: int = 0
    unvisited: int = 0
    """Left unweighed when the search ran out of its time budget (stopped_by_time)."""
    seconds: float = 0.0
    stopped_by_time: bool = False
    smallest_refused: list[tuple[int, str]] = field(default_factory=list)
    """(bytes needed, layout) of the leanest layouts memory refused, when none fits."""


def compute_bound(config: JobConfig, costs: LayoutCosts) -> float:
    """A lower bound on the step, the largest over the pipeline ranks of: the forwards of
    the chunks before the rank's first (microbatch 0 must pass them before it can
    start), then all its compute (every forward and backward of its chunks for every
    microbatch), then either its update or, for whole backwards, the backwards of those
    earlier chunks followed by the first rank's update (its last backward, of its first
    chunk, is the last of its computes, and that microbatch's gradient must still pass
    them). Split backwards leave no such order: their W may come after."""
    p = config.parallel
    ranks = chunk_ranks(p.schedule, p.pp, p.vpp)
    split = p.schedule in ("zb-h1", "zbv")
    busy = [0.0] * p.pp
    for chunk, rank in enumerate(ranks):
        backward = costs.input_s[chunk] + costs.weight_s[chunk] if split else costs.backward_s[chunk]
        busy[rank] += p.microbatches * (costs.forward_s[chunk] + backward)
    bound = 0.0
    for rank in range(p.pp):
        before = range(ranks.index(rank))
        warmup = sum(costs.forward_s[c] for c in before)
        after = costs.update_s[rank]
        if not split and before:
            after = max(after, sum(costs.backward_s[c] for c in before) + costs.update_s[ranks[0]])
        bound = max(bound, warmup + busy[rank] + after)
    return bound


def programs_for(config: JobConfig) -> list[list[Action]]:
    """The step programs of a config's layout, by pipeline rank."""
    p = config.parallel
    return build_programs(p.schedule, p.pp, p.vpp, p.microbatches, p.dp, p.zero, p.zero_prefetch,
                          tied=bool(config.model.tie_embeddings))


def simulate_layout(config: JobConfig, programs: list[list[Action]], costs: LayoutCosts) -> SimResult:
    """The step the simulator predicts: each compute its chunk's cost, each update its
    rank's, each send, receive and exchange its rank's work posting it and each message
    the measured link's time, each reduction and gather the collective's."""
    measured: list[list[float | None]] = []
    for rank, program in enumerate(programs):
        row: list[float | None] = []
        for action in program:
            if action.kind in COMPUTE:
                row.append(_compute_s(costs, action))
            elif action.kind is Kind.OPTIMIZER_STEP:
                row.append(costs.update_s[rank])
            elif action.p2p_ops():
                row.append(costs.posting_s(len(action.p2p_ops())))
            else:
                row.append(None)
        measured.append(row)
    cost = CostModel(latency_s=costs.message_s, reduce_s=costs.reduce_s, gather_s=costs.gather_s)
    return simulate(programs, cost, links=LINKS, measured=measured)


def _compute_s(costs: LayoutCosts, action: Action) -> float:
    table = {Kind.FORWARD: costs.forward_s, Kind.BACKWARD: costs.backward_s,
             Kind.BACKWARD_INPUT: costs.input_s, Kind.BACKWARD_WEIGHT: costs.weight_s}
    return table[action.kind][action.chunk]


def hosts_text(cluster: Cluster) -> str:
    """The cluster's hosts as the planner's messages name them: "6 a host", or a
    coordinator's as they are, "hosts of 6, 3 and 3"."""
    if not cluster.host_sizes:
        return f"{cluster.servers_per_host} a host"
    sizes = [str(size) for size in cluster.host_sizes]
    return "hosts of " + (f"{', '.join(sizes[:-1])} and {sizes[-1]}" if len(sizes) > 1 else sizes[0])


def why_unplannable(config: JobConfig, cluster: Cluster) -> str | None:
    """Why no layout of `cluster` can run `config`, whatever the costs and memory: no
    layout uses every server, or the config's rules (and the servers' devices') refuse
    every one, the first one's rule then named. None as soon as one layout passes, so
    that the planner can say this before it measures any cost (which may take minutes
    on the servers) and the search need not. Microbatch counts past 8 * pp * vpp are
    tried too before a refusal (the search's second pass takes them)."""
    seen: set[Layout] = set()
    first = None
    for every_count in (False, True):
        for layout in layouts(config, cluster.servers, cluster.servers_per_host, head_layers(config), every_count,
                              cluster.host_sizes):
            if layout in seen:  # the second pass's layouts include the first's
                continue
            seen.add(layout)
            try:
                checked(config, layout, cluster.device_type)
                return None
            except ConfigError as err:
                first = first or err
    m = config.model
    if not seen:
        return (f"no layout uses all {cluster.servers} servers: dp·tp·pp = {cluster.servers} needs dp to divide "
                f"train.global_batch={config.train.global_batch} (a replica's samples making at least pp "
                f"microbatches), each tensor group of tp servers on one host ({hosts_text(cluster)}) and tp "
                f"to divide model.n_heads={m.n_heads}, the key/value heads ({m.n_kv_heads}) and the MLP's width "
                f"({m.ffn_hidden}), and pp at most model.n_layers={m.n_layers}")
    return f"each of the {len(seen)} layouts of {cluster.servers} servers breaks a rule; the first: {first}"


BUDGET_S = 50.0
"""Where the search stops weighing layouts (the report says how many it left): within
the minute a 7B-class model on 64 servers may take, with the profile read first."""


def search(config: JobConfig, cluster: Cluster, profile: DeviceProfile, top: int = 5,
           budget_s: float = BUDGET_S, every_microbatch_count: bool = False) -> SearchReport:
    """The `top` fastest layout shapes that fit, best first (ties: less memory first),
    each with its variant chosen as _chosen_variant says.
    `every_microbatch_count`: microbatch counts past 8 * pp * vpp as well
    (candidates.microbatch_counts), where with no more than that nothing fits."""
    started = time.monotonic()
    valid, refused = valid_configs(config, cluster.servers, cluster.servers_per_host, head_layers(config),
                                   every_microbatch_count, cluster.host_sizes, cluster.device_type)
    report = SearchReport([], candidates=len(valid) + refused, refused_by_rules=refused)
    bounded = []
    for layout, cfg in valid:
        costs = layout_costs(cfg, profile, cluster.compute_slowdown)
        bounded.append((compute_bound(cfg, costs), layout, cfg, costs))
    # Equal bounds: sequence parallelism, lower ZeRO stages and less recompute first (as
    # fast, and fewer collectives or reruns for the same prediction).
    bounded.sort(key=lambda b: (b[0], not b[1].sequence_parallel, b[1].zero, RECOMPUTE_ORDER.index(b[1].recompute)))
    programs_cache: dict[tuple, list[list[Action]]] = {}
    simulated: set[Layout] = set()
    refused_sizes: list[tuple[int, str]] = []
    outcomes: dict[Layout, Outcome] = {}
    variants_of: dict[tuple, list[RankedPlan]] = {}
    chosen: dict[tuple, RankedPlan] = {}
    for index, (bound, layout, cfg, costs) in enumerate(bounded):
        if len(report.plans) >= top and bound >= report.plans[top - 1].step_s * (1 - TOLERANCE):
            report.bounded_out = len(bounded) - index
            break
        if time.monotonic() - started > budget_s:
            report.stopped_by_time = True
            report.unvisited = len(bounded) - index
            break
        if _dominated(layout, simulated):
            report.dominated += 1
            outcomes[layout] = Outcome("dominated")
            continue
        p = cfg.parallel
        key = (p.schedule, p.pp, p.vpp, p.microbatches, p.dp > 1, p.zero, p.zero_prefetch, cfg.model.tie_embeddings)
        if key not in programs_cache:  # the programs depend on dp only through dp > 1
            programs_cache[key] = programs_for(cfg)
        programs = programs_cache[key]
        peaks = [with_temporaries(prediction) for prediction in predict(cfg, programs, cluster.device_type)]
        if max(peaks) + RUNTIME_RESERVE_BYTES > cluster.memory_bytes:
            report.refused_by_memory += 1
            refused_sizes.append((max(peaks) + RUNTIME_RESERVE_BYTES, layout.describe()))
            outcomes[layout] = Outcome("refused", needed_bytes=max(peaks) + RUNTIME_RESERVE_BYTES)
            continue
        result = simulate_layout(cfg, programs, costs)
        report.simulated += 1
        simulated.add(layout)
        outcomes[layout] = Outcome("simulated", result.makespan_s, max(peaks))
        plan = RankedPlan(layout, cfg, result.makespan_s, result.bubble_fraction, peaks, costs, bound)
        shape = _shape(layout)  # one plan per shape: its variant chosen among those simulated
        variants_of.setdefault(shape, []).append(plan)
        chosen[shape] = _chosen_variant(variants_of[shape])
        if (len(report.plans) < top or _order(chosen[shape]) < _order(report.plans[-1])
                or any(_shape(kept.layout) == shape for kept in report.plans)):
            report.plans = heapq.nsmallest(top, chosen.values(), key=_order)
    unvisited = Outcome("unweighed" if report.stopped_by_time else "bounded")
    shapes = {_shape(plan.layout) for plan in report.plans}
    variants = {b[1]: outcomes.get(b[1], unvisited) for b in bounded if _shape(b[1]) in shapes}
    report.plans = [_with_reasons(plan, variants, cluster.memory_bytes) for plan in report.plans]
    if not report.plans:
        report.smallest_refused = sorted(refused_sizes)[:3]
    report.seconds = time.monotonic() - started
    return report


def _with_reasons(plan: RankedPlan, variants: dict[Layout, Outcome], memory_bytes: int) -> RankedPlan:
    """The plan, with how the layouts of its shape fared (explain.variant_lines)."""
    shape = _shape(plan.layout)
    rivals = {layout: outcome for layout, outcome in variants.items()
              if _shape(layout) == shape and layout != plan.layout}
    lines = variant_lines(plan.layout, plan.step_s, max(plan.peak_bytes), memory_bytes, rivals)
    return dataclasses.replace(plan, why_variants=tuple(lines))


def _dominated(layout: Layout, simulated: set[Layout]) -> bool:
    """Whether the same layout with less recompute fitted: that one is faster (a rerun
    only adds time), and fitting, needs none of what this one saves. (Sequence
    parallelism has no such rule: the measured laws price its reduce-scatters and
    all-gathers apart from the all-reduces it replaces, so either may be faster.)"""
    index = RECOMPUTE_ORDER.index(layout.recompute)
    return any(dataclasses.replace(layout, recompute=r) in simulated for r in RECOMPUTE_ORDER[:index])


def _shape(layout: Layout) -> tuple:
    """What makes two plans different layouts rather than variants of one."""
    return layout.dp, layout.tp, layout.pp, layout.vpp, layout.schedule, layout.microbatches, layout.layers


def _chosen_variant(variants: list[RankedPlan]) -> RankedPlan:
    """Of a shape's simulated variants (ZeRO stage, recompute, sequence parallelism), the
    one to rank: among those within VARIANT_TIE of the fastest, the one holding least,
    then the lowest ZeRO stage, then the least recompute."""
    fastest = min(plan.step_s for plan in variants)
    return min((plan for plan in variants if plan.step_s <= fastest * (1 + VARIANT_TIE)), key=_simpler)


def _simpler(plan: RankedPlan) -> tuple:
    layout = plan.layout
    return max(plan.peak_bytes), layout.zero, RECOMPUTE_ORDER.index(layout.recompute), not layout.sequence_parallel


def _order(plan: RankedPlan) -> tuple:
    """Faster first; at equal predicted time, less memory. (Not rounded: the plans are
    printed best first, and their times must read in order.)"""
    return plan.step_s, max(plan.peak_bytes)
