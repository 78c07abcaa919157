"""Every layout the planner weighs for a model on a cluster: pure enumeration, before any
cost or memory is looked at.

A layout uses every server: dp * tp * pp = servers. Each tensor group fits on one host
(it talks every layer: tensor_groups_fit), and tp divides the model's heads, key/value
heads and MLP width; pp is at most n_layers. Per (dp, tp, pp): every schedule that runs
that pp (one chunk per rank for gpipe, 1f1b and zb-h1; vpp 2 to 4 for interleaved-1f1b;
the V's 2 for zbv; a single stage runs 1f1b), microbatch counts that divide the replica's
samples (at most 8 * pp * vpp of them, since more only adds per-microbatch cost once the
bubble is small), every ZeRO stage where dp > 1, every recompute mode, sequence
parallelism on or off where tp > 1, and beside the even split of the layers the one
that takes layers off the head's chunk (head_balanced_split). The job config's rules are applied to each
(config/job.py) and the ones they refuse are counted, not kept.

Worked example: 2 servers on one host, a 4-layer model, global batch 8 gives
(dp, tp, pp) = (2, 1, 1), (1, 2, 1), (1, 1, 2); for (1, 1, 2) the schedules gpipe, 1f1b,
zb-h1 (microbatches 2, 4, 8), interleaved-1f1b with vpp 2 (microbatches 2, 4, 8) and zbv
(microbatches 2, 4, 8), each under recompute none, selective and full.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

from interleaf.coordinator.config import ConfigError, JobConfig
from interleaf.coordinator.plan import check_fp8

SINGLE_CHUNK = ("gpipe", "1f1b", "zb-h1")
MAX_VPP = 4
RECOMPUTE_ORDER = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    vpp: int
    schedule: str
    microbatches: int
    zero: int
    recompute: str
    sequence_parallel: bool = False
    layers: tuple[int, ...] = ()
    """Layers per chunk; empty: the even split."""

    def parallel(self) -> dict:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "vpp": self.vpp, "schedule": self.schedule,
                "microbatches": self.microbatches, "zero": self.zero, "sequence_parallel": self.sequence_parallel,
                "layers": list(self.layers)}

    def train(self) -> dict:
        values: dict = {"recompute": self.recompute}
        if self.recompute != "selective":
            values["recompute_layers"] = 0
        return values

    def describe(self) -> str:
        text = f"dp{self.dp}·tp{self.tp}·pp{self.pp}"
        if self.vpp > 1:
            text += f"·vpp{self.vpp}"
        text += f" {self.schedule} m={self.microbatches}"
        if self.zero:
            text += f" zero{self.zero}"
        if self.recompute != "none":
            text += f" recompute={self.recompute}"
        if self.sequence_parallel:
            text += " sp"
        if self.layers:
            text += " layers=" + ",".join(map(str, self.layers))
        return text


UNPLANNED_LAYOUT = ["parallel.dp=1", "parallel.tp=1", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                    "parallel.microbatches=1", "parallel.zero=0", "parallel.sequence_parallel=false",
                    "parallel.layers=[]"]
"""Overrides that set aside a layout that breaks the rules, where the config is being
planned: one server, one chunk, one microbatch. The plan's own layout replaces it
(apply). (Settings that need more, parallel.elastic's data parallelism, must come with
a valid layout.)"""


PLACEHOLDER_DPS = (2, 3, 4, 5, 6, 7, 8)
"""Replicas a placeholder layout may take where parallel.elastic needs dp >= 2: the
first that divides train.global_batch passes (a global batch of 9 takes 3)."""


def load_unplanned(text: str, sets: list[str]) -> JobConfig:
    """The config of `text` and `sets` with its layout set aside (UNPLANNED_LAYOUT), or
    where a rule ties another setting to the layout, with that rule met as well:
    microbatches of one sample (eval.samples must be a multiple of the microbatch's
    rows, which one sample always is), replicas (parallel.elastic needs dp >= 2; the
    first of PLACEHOLDER_DPS that divides the global batch), no blocks rerun whole
    (train.recompute_layers needs selective recompute, which the plan chooses afresh).
    ConfigError, the first placeholder's, when the config breaks a rule beyond its
    layout, or gives a layout setting of the wrong type or a value no layout takes
    (parallel.check_layout_values)."""
    from interleaf.coordinator.config import load_config
    from interleaf.coordinator.config.loading import given_settings
    from interleaf.coordinator.config.parallel import check_layout_values

    layout_keys = {setting.split("=")[0].split(".")[1] for setting in UNPLANNED_LAYOUT}
    check_layout_values({k: v for k, v in given_settings(text, sets, "parallel").items() if k in layout_keys})
    first: ConfigError | None = None
    replicas: list[list[str]] = [[]] + [[f"parallel.dp={dp}"] for dp in PLACEHOLDER_DPS]
    for extra in [dp + recompute for recompute in ([], ["train.recompute_layers=0"]) for dp in replicas]:
        placeholder = sets + UNPLANNED_LAYOUT + extra
        try:
            return load_config(text, placeholder)
        except ConfigError as err:
            first = first or err
        try:
            config = load_config(text, placeholder + ["eval.every=0"])
            rows_of_one = config.train.global_batch // config.parallel.dp
            return load_config(text, placeholder + [f"parallel.microbatches={rows_of_one}"])
        except ConfigError:
            pass
    assert first is not None
    raise first


def apply(config: JobConfig, layout: Layout) -> JobConfig:
    """`config` with `layout`'s settings; ConfigError where a rule refuses them. The
    plan itself (parallel.plan) is spent: the result names one layout."""
    parallel = dataclasses.replace(config.parallel, plan="", **{**layout.parallel(), "layers": layout.layers})
    train = dataclasses.replace(config.train, **layout.train())
    return dataclasses.replace(config, parallel=parallel, train=train)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tensor_groups_fit(servers: int, servers_per_host: int, tp: int, host_sizes: tuple[int, ...] = ()) -> bool:
    """Whether every tensor group of `tp` ranks can sit on one host (as grid.place puts
    them where hosts have room): on hosts of `host_sizes` servers where known (a
    coordinator's), else on hosts of `servers_per_host` and a last one of the rest.
    12 servers, 6 a host, fit groups of 1, 2, 3 or 6, not of 4 (a host of 6 holds one
    such group, and three are needed); hosts of 6, 3 and 3 fit groups of 1 or 3, not of
    2 (3 + 1 + 1 of the 6 needed)."""
    if not host_sizes:
        full, rest = divmod(servers, servers_per_host)
        host_sizes = (servers_per_host,) * full + (rest,)
    return sum(size // tp for size in host_sizes) >= servers // tp


def grids(config: JobConfig, servers: int, servers_per_host: int,
          host_sizes: tuple[int, ...] = ()) -> Iterator[tuple[int, int, int]]:
    """(dp, tp, pp) using every server, each tensor group within a host and tp dividing
    the model's split dimensions, pp at most the layers."""
    m = config.model
    for tp in divisors(servers):
        if not tensor_groups_fit(servers, servers_per_host, tp, host_sizes) or m.n_heads % tp or m.n_kv_heads % tp \
                or m.ffn_hidden % tp:
            continue
        for pp in divisors(servers // tp):
            if pp <= m.n_layers:
                yield servers // (tp * pp), tp, pp


def pipelines(pp: int, n_layers: int) -> Iterator[tuple[str, int]]:
    """(schedule, vpp) that run pp pipeline ranks."""
    if pp == 1:
        yield "1f1b", 1
        return
    for schedule in SINGLE_CHUNK:
        yield schedule, 1
    for vpp in range(2, MAX_VPP + 1):
        if pp * vpp <= n_layers:
            yield "interleaved-1f1b", vpp
    if 2 * pp <= n_layers:
        yield "zbv", 2


def microbatch_counts(samples: int, pp: int, vpp: int, schedule: str, every: bool = False) -> list[int]:
    """Divisors of a replica's samples per step, from pp (fewer leave most ranks idle)
    to 8 * pp * vpp (`every`: to all of the samples, microbatches of one, for a model
    whose activations fit no fewer); interleaved-1f1b needs multiples of pp."""
    low, high = (pp if pp > 1 else 1), (samples if every else 8 * pp * vpp)
    counts = [m for m in divisors(samples) if low <= m <= high]
    if schedule == "interleaved-1f1b":
        counts = [m for m in counts if m % pp == 0]
    return counts or [m for m in divisors(samples) if schedule != "interleaved-1f1b" or m % pp == 0][-1:]


def head_balanced_split(n_layers: int, chunks: int, head_layers: float) -> tuple[int, ...]:
    """Layers per chunk that even out the chunks' work when the last one also runs the
    head, costing `head_layers` layers: the last chunk gets the share left after its
    head (at least one layer), the others the rest, as evenly as they divide; () where
    that is the even split itself.

    Worked example: 8 layers in 4 chunks, a head costing 2 layers: each chunk's share
    of the 10 layers' work is 2.5, the last chunk takes round(2.5 - 2) = 0, raised to
    the least of 1, and the other 7 layers spread 3, 2, 2: (3, 2, 2, 1).
    """
    if chunks < 2:
        return ()
    last = max(1, min(n_layers - (chunks - 1), round((n_layers + head_layers) / chunks - head_layers)))
    base, extra = divmod(n_layers - last, chunks - 1)
    sizes = tuple(base + (1 if c < extra else 0) for c in range(chunks - 1)) + (last,)
    even_base, even_extra = divmod(n_layers, chunks)
    even = tuple(even_base + (1 if c < even_extra else 0) for c in range(chunks))
    return () if sizes == even or min(sizes) < 1 else sizes


def layouts(config: JobConfig, servers: int, servers_per_host: int, head_layers: float = 0.0,
            every_microbatch_count: bool = False, host_sizes: tuple[int, ...] = ()) -> Iterator[Layout]:
    """Every candidate layout, before the config's rules are applied; `head_layers`: the
    head's cost in layers, for the split that evens it out; `every_microbatch_count`:
    microbatch counts beyond 8 * pp * vpp too (microbatch_counts); `host_sizes`: the
    servers of each host, where known (tensor_groups_fit)."""
    for dp, tp, pp in grids(config, servers, servers_per_host, host_sizes):
        if config.train.global_batch % dp:
            continue
        for schedule, vpp in pipelines(pp, config.model.n_layers):
            splits = {(), head_balanced_split(config.model.n_layers, pp * vpp, head_layers)}
            for microbatches in microbatch_counts(config.train.global_batch // dp, pp, vpp, schedule,
                                                  every_microbatch_count):
                for zero in (range(4) if dp > 1 else (0,)):
                    for recompute in RECOMPUTE_ORDER:
                        for sp in ((False, True) if tp > 1 else (False,)):
                            for split in sorted(splits):
                                yield Layout(dp, tp, pp, vpp, schedule, microbatches, zero, recompute, sp, split)


def checked(config: JobConfig, layout: Layout, device_type: str | None = None) -> JobConfig:
    """`config` under `layout`, or ConfigError where the config's rules refuse it - and,
    given the servers' `device_type`, where their devices do (float8 tensor cores need
    microbatch tokens that are multiples of 16: plan.check_fp8)."""
    cfg = apply(config, layout)
    if device_type is not None:
        check_fp8(cfg, [device_type])
    return cfg


def valid_configs(config: JobConfig, servers: int, servers_per_host: int, head_layers: float = 0.0,
                  every_microbatch_count: bool = False, host_sizes: tuple[int, ...] = (),
                  device_type: str | None = None) -> tuple[list[tuple[Layout, JobConfig]], int]:
    """(layout, its config) for every candidate the rules (and, given, the devices:
    `checked`) admit, and how many they refused."""
    kept, refused = [], 0
    for layout in layouts(config, servers, servers_per_host, head_layers, every_microbatch_count, host_sizes):
        try:
            kept.append((layout, checked(config, layout, device_type)))
        except ConfigError:
            refused += 1
    return kept, refused
