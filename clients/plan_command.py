"""`interleaf plan` and `interleaf run --plan auto`: the cluster to plan for, its device
profile (cached, or measured on its servers), the search, and the report.

Worked example: `interleaf plan --servers 4 --server-memory 2000000000 --top 3` plans a
described cluster of four servers with 2 GB each: it reads the cached profile of the
model on this machine's device (measuring it on two local servers first, once), searches
every layout of four servers and prints the three fastest that fit, each with its
predicted step, bubble, peak memory and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from interleaf.common.model.compile_modes import device_type_of
from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.planner.costs import DeviceProfile
from interleaf.coordinator.planner.explain import explain
from interleaf.coordinator.admission import RUNTIME_RESERVE_BYTES, amount_text
from interleaf.coordinator.planner.search import (BUDGET_S, Cluster, SearchReport, hosts_text, search,
                                                  why_unplannable)

from interleaf.clients import plan_profile


class PlanError(ValueError):
    """No layout fits, or the cluster cannot be planned for; the message says why."""


def host_slowdown(servers_on_host: int, threads_per_server: int, cores: int) -> float:
    """How much slower each local server computes when all compute at once: their
    threads over the host's cores, at least 1."""
    return max(1.0, servers_on_host * threads_per_server / max(1, cores))


def local_cluster(servers: int, device: str, memory_bytes: int | None = None) -> tuple[Cluster, str]:
    """A cluster of `servers` local servers on this machine (interleaf run --local), and
    their device kind."""
    from interleaf.clients.launcher import local_devices, memory_per_local_server, threads_per_local_server

    devices = local_devices(device, servers)
    cores = os.cpu_count() or 1
    slowdown = host_slowdown(servers, threads_per_local_server(servers, cores), cores) if devices[0] == "cpu" else 1.0
    memory = memory_bytes or memory_per_local_server(devices)
    return Cluster(servers, memory, servers_per_host=servers, compute_slowdown=slowdown,
                   device_type=device_type_of(devices)), device_kind(devices[0])


def device_kind(device: str) -> str:
    """What a profile is cached under: cpu, or cuda and the GPU's name for local servers
    (a coordinator's servers report only cpu or cuda:N, so theirs are cached under cuda)."""
    if device.startswith("cuda"):
        import torch

        return f"cuda ({torch.cuda.get_device_name(torch.device(device))})"
    return "cpu"


def remote_cluster(servers) -> tuple[Cluster, str]:
    """The idle servers a coordinator has registered (ListServers)."""
    idle = [s for s in servers if s.state == "IDLE"]
    if not idle:
        raise PlanError("the coordinator has no idle server to plan for")
    kinds = sorted({s.device.split(":")[0] for s in idle})  # cuda:0, cuda:1 ... on one host are one kind
    if len(kinds) > 1:
        raise PlanError(f"the idle servers compute on {', '.join(kinds)}: a job's servers share one device kind")
    hosts: dict[str, int] = {}
    for s in idle:
        hosts[s.host] = hosts.get(s.host, 0) + 1
    return Cluster(len(idle), min(s.memory_bytes for s in idle), servers_per_host=max(hosts.values()),
                   device_type=kinds[0], host_sizes=tuple(sorted(hosts.values(), reverse=True))), kinds[0]


def obtain_profile(config: JobConfig, device: str, *, servers: ProfileServers | None,
                   profile_path: str | None = None, log=print) -> DeviceProfile:
    """--profile's file, else the cache's, else measured on `servers` and cached."""
    if profile_path:
        try:
            with open(profile_path) as f:
                return DeviceProfile.from_json(json.load(f))
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise PlanError(f"--profile {profile_path}: not a device profile ({err})") from None
    if servers is None:
        raise PlanError(f"no servers were given to measure the device profile of this model on {device}")
    try:
        setup = plan_profile.profile_setup(config, device, servers.memory_bytes)
        cached = plan_profile.load_cached(setup, device)
        if cached is not None:
            log(f"device profile from the cache ({plan_profile.cache_dir()})")
            return cached
        log(f"measuring the device profile of this model on {device}")
        with servers.open() as (client, idle):
            profile = plan_profile.measure(client, config, device, idle, servers.memory_bytes, log=log)
    except plan_profile.ProfileJobFailed as err:
        raise PlanError(f"measuring the device profile: {err}") from None
    path = plan_profile.store(profile, setup)
    log(f"device profile written to {path}")
    return profile


def describe_profile(profile: DeviceProfile) -> str:
    f, b = profile.forward, profile.backward
    links = ", ".join(f"{kind} {law.overhead_s * 1e6:.0f} µs + {law.rate / 1e9:.2f} GB/s"
                      for kind, law in profile.links.items())
    posting = profile.posting
    return (f"costs measured on {profile.device} ({profile.measured_on}): forward {f.overhead_s * 1e3:.2f} ms + "
            f"{f.rate / 1e9:.1f} GFLOP/s, backward {b.overhead_s * 1e3:.2f} ms + {b.rate / 1e9:.1f} GFLOP/s; "
            f"links {links}; posting a message "
            + (f"{posting.overhead_s * 1e6:.0f} µs + {posting.rate / 1e9:.2f} GB/s" if posting else "free"))


TIMED_PLANS = 8
"""How many of the plans the laws rank first have their chunk shapes run on the servers
before the search is repeated at what those took."""
SHAPE_ROUNDS = 2
"""Searches repeated with newly timed shapes, at most: a repeated search can rank plans
of other shapes first."""


@dataclass(frozen=True)
class ProfileServers:
    """The servers profile and shape jobs run on."""
    open: Callable
    """() -> a context of (client, idle servers)."""
    count: int
    memory_bytes: int
    """What each offers: a shape job the memory model says would not fit is not run."""
    slowdown: float = 1.0
    """How much slower each computes when all do (shared cores): taken out of what a
    shape job, which keeps them all busy, measures."""


def search_timed(config: JobConfig, cluster: Cluster, profile: DeviceProfile, top: int,
                 servers: ProfileServers | None, log=print,
                 keep: bool = True) -> tuple[SearchReport, DeviceProfile]:
    """The search, with every chunk shape of its first TIMED_PLANS plans that `servers`
    can run run there and priced at what it took (plan_profile.measure_shapes), the
    profile stored with them (`keep`), and the search repeated. Without servers to run
    them on, or for a model profiled through a proxy (whose chunks are not the
    model's), the laws price every shape."""
    if servers is None or not plan_profile.own_widths(
            config, plan_profile.profile_model(config, profile.device, servers.memory_bytes)):
        return run_search(config, cluster, profile, top), profile
    wanted = max(top, TIMED_PLANS)
    report = run_search(config, cluster, profile, wanted)
    for _ in range(SHAPE_ROUNDS):
        needs = plan_profile.untimed_shapes([plan.config for plan in report.plans], profile)
        if not plan_profile.shape_jobs(needs, servers.count):  # none, or none these servers run
            break
        log(f"timing {len(needs)} chunk shapes of the top {len(report.plans)} plans on the servers")
        with servers.open() as (client, idle):
            timed = plan_profile.measure_shapes(client, config, profile, needs, idle, servers.memory_bytes,
                                                servers.slowdown, log=log)
        if timed is profile:  # none of the jobs ran
            break
        profile = timed
        if keep:
            plan_profile.store(profile, plan_profile.profile_setup(config, profile.device, servers.memory_bytes))
        report = run_search(config, cluster, profile, wanted)
    report.plans = report.plans[:top]
    return report, profile


def check_plannable(config: JobConfig, cluster: Cluster) -> None:
    """PlanError where no layout of `cluster` passes the rules (search.why_unplannable):
    asked before the profile is measured, which takes minutes where it runs jobs."""
    why = why_unplannable(config, cluster)
    if why:
        raise PlanError(why)


def run_search(config: JobConfig, cluster: Cluster, profile: DeviceProfile, top: int) -> SearchReport:
    """The search; where memory or the rules refused every layout, again with more
    microbatches (each smaller, so that fewer activations are in flight) than pay off in
    the bubble."""
    report = search(config, cluster, profile, top=top)
    # Memory refused some, or the rules all: more microbatches are smaller ones, and may
    # meet a rule on the microbatch's rows (eval.samples) that fewer could not.
    refused = report.refused_by_memory or report.refused_by_rules == report.candidates
    if not report.plans and refused and not report.stopped_by_time:
        report = search(config, cluster, profile, top=top, every_microbatch_count=True,
                        budget_s=max(0.0, BUDGET_S - report.seconds))
    if not report.candidates or report.refused_by_rules == report.candidates:
        check_plannable(config, cluster)
    if not report.plans and report.stopped_by_time:
        raise PlanError(f"the search stopped at its {BUDGET_S:g} s budget with {report.unvisited} of "
                        f"{report.candidates} layouts of {cluster.servers} servers unweighed and none of the others "
                        f"fitting {amount_text(cluster.memory_bytes)} each")
    if not report.plans:
        leanest = "; ".join(f"{layout} needs {amount_text(need)}" for need, layout in report.smallest_refused)
        reserve = (f"; admission's runtime reserve alone is {amount_text(RUNTIME_RESERVE_BYTES)}"
                   if cluster.memory_bytes <= RUNTIME_RESERVE_BYTES else "")
        raise PlanError(f"no layout of {cluster.servers} servers fits {amount_text(cluster.memory_bytes)} each"
                        + (f" (leanest: {leanest})" if leanest else "") + reserve
                        + f"; {report.refused_by_rules} of {report.candidates} candidates broke the config's rules")
    return report


def report_text(report: SearchReport, cluster: Cluster, profile: DeviceProfile, config: JobConfig) -> str:
    tokens = config.train.global_batch * config.model.seq_len
    width = max([48] + [len(plan.layout.describe()) for plan in report.plans])  # the columns stay aligned
    lines = [describe_profile(profile),
             f"{cluster.servers} server{'s' if cluster.servers != 1 else ''} of {amount_text(cluster.memory_bytes)}, "
             f"{hosts_text(cluster)}"
             + (f", computing {cluster.compute_slowdown:.1f}x slower when all are busy (shared cores)"
                if cluster.compute_slowdown > 1 else ""),
             f"searched {report.candidates} layouts in {report.seconds:.1f} s: {report.refused_by_rules} broke the "
             f"config's rules, {report.refused_by_memory} would not fit, {report.simulated} simulated, "
             f"{report.dominated} matched by a fitting one with less recompute, "
             f"{report.bounded_out} could not beat the top by their compute alone"
             + (f", {report.unvisited} not weighed: the search stopped at its time budget, so a faster layout "
                f"may be among them" if report.stopped_by_time else ""),
             ""]
    rows = [[str(i), plan.layout.describe(), f"{plan.step_s:.4f}", f"{tokens / plan.step_s:,.0f}",
             f"{plan.bubble:.1%}", f"{max(plan.peak_bytes) / 2**30:.3f}"] for i, plan in enumerate(report.plans, 1)]
    header = ["#", "layout", "step s", "tokens/s", "bubble", "peak GiB"]
    # each column at least as wide as it always was, wider where an entry is (a 7B
    # model's step of 10,000 s or more)
    widths = [max([least] + [len(row[c]) for row in rows]) for c, least in enumerate((2, width, 9, 10, 7, 9))]
    for row in [header] + rows:
        cells = [row[c].ljust(widths[c]) if c == 1 else row[c].rjust(widths[c]) for c in range(6)]
        lines.append(f"{cells[0]}  {' '.join(cells[1:])}")
    best = report.plans[0]
    for i, plan in enumerate(report.plans, 1):
        lines.append(f"\n{i}. {plan.layout.describe()}")
        lines += [f"   {line}" for line in explain(plan, best)]
    lines.append("\nrun the best: " + " ".join(set_arguments(best.as_json())))
    return "\n".join(lines)


def set_arguments(plan: dict) -> list[str]:
    """--set SECTION.KEY=VALUE for each of a plan's settings."""
    out = []
    for section in ("parallel", "train"):
        for key, value in plan[section].items():
            out += ["--set", f"{section}.{key}={_set_value(value)}"]
    return out


def _set_value(value) -> str:
    """A setting's value as --set takes it: 5,3 for a list, nothing when empty (no
    brackets for a shell to glob: zsh refuses an unmatched [], bash may expand it); true
    or false."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def _setting_text(value) -> str:
    """A setting's value from TOML, --set's text or a plan, in one spelling to compare."""
    return _set_value(value).strip().lower().replace(" ", "").strip("[]")


def replaced_settings(text: str, sets: list[str], plan: dict) -> list[str]:
    """The layout settings the user gave (in the config's text or as --set) that `plan`
    (as_json's) sets otherwise, as "parallel.schedule zbv -> 1f1b": planning chooses every
    one of them afresh, and says so rather than drop them unseen."""
    import tomllib

    chosen = {f"{section}.{key}": value for section in ("parallel", "train") for key, value in plan[section].items()}
    given: dict[str, object] = {}
    try:
        table = tomllib.loads(text)
    except tomllib.TOMLDecodeError:  # the config was read already: it parsed there
        table = {}
    for name in chosen:
        section, key = name.split(".")
        if key in table.get(section, {}):
            given[name] = table[section][key]
    for item in sets:
        name, _, value = item.partition("=")
        if name.strip() in chosen:
            given[name.strip()] = value
    return [f"{name} {_setting_text(value) or '[]'} -> {_setting_text(chosen[name]) or '[]'}"
            for name, value in given.items() if _setting_text(value) != _setting_text(chosen[name])]


def overrides(plan: dict) -> list[str]:
    args = set_arguments(plan)
    return [a for a in args if a != "--set"] + ["parallel.plan="]


def print_json(report: SearchReport, file=None) -> None:
    file = file or sys.stdout  # the stdout of the call, not of the import
    json.dump([plan.as_json() for plan in report.plans], file, indent=1)
    file.write("\n")


@contextlib.contextmanager
def local_servers(count: int, device: str):
    """`count` stage servers started here for the profile jobs, stopped after."""
    from interleaf.clients.launcher import LocalCluster

    # metered servers: their StepReports carry the per-group calls the link laws are fitted to
    with LocalCluster(count, device=device) as cluster:
        yield cluster.client(), count


@contextlib.contextmanager
def given_servers(client, idle: int):
    yield client, idle


def plan_described(config: JobConfig, servers: int, memory_bytes: int | None, servers_per_host: int | None,
                   device: str, top: int, profile_path: str | None, log) -> tuple[SearchReport, Cluster, DeviceProfile]:
    """Plans for `servers` servers that need not exist; costs measured on this machine's
    device (two local servers) unless cached or given."""
    from interleaf.clients.launcher import local_devices, memory_per_local_server
    from interleaf.coordinator.config import ConfigError
    from interleaf.coordinator.plan import check_devices

    if profile_path and memory_bytes:  # costs and memory both given: nothing here is run or read
        profile = obtain_profile(config, "", profile_path=profile_path, log=log, servers=None)
        cluster = Cluster(servers, memory_bytes, servers_per_host=min(servers_per_host or 8, servers),
                          device_type=device_type_of([profile.device]))
        return run_search(config, cluster, profile, top), cluster, profile
    try:  # two servers to profile on, or one on a machine with one GPU
        try:
            devices = local_devices(device, min(2, servers))
        except ValueError:
            devices = local_devices(device, 1)
    except ValueError as err:
        raise PlanError(f"--device {device}: the profile jobs run on this machine's devices, and {err}"
                        + ("; with --profile, --server-memory plans without any here" if profile_path else "")) from None
    local_memory = memory_per_local_server(devices)
    local = None
    if not profile_path:  # the profile and shape jobs run on these devices: the coordinator's checks of them
        try:
            check_devices(config, devices, tokens=False)  # the layout is the plan's to choose
        except ConfigError as err:
            raise PlanError(f"the profile jobs run on this machine's {devices[0]}: {err}") from None
        local = ProfileServers(lambda: local_servers(len(devices), device), len(devices), local_memory)
    given = obtain_profile(config, "", profile_path=profile_path, log=log, servers=None) if profile_path else None
    cluster = Cluster(servers, memory_bytes or local_memory, servers_per_host=min(servers_per_host or 8, servers),
                      device_type=device_type_of([given.device] if given else devices))
    check_plannable(config, cluster)  # before the profile's jobs, which take minutes on a large model
    profile = given or obtain_profile(config, device_kind(devices[0]), log=log, servers=local)
    report, profile = search_timed(config, cluster, profile, top, local, log)
    return report, cluster, profile


def plan_on(client, config: JobConfig, cluster: Cluster, device: str, top: int, profile_path: str | None,
            log, servers_memory_bytes: int | None = None) -> tuple[SearchReport, DeviceProfile]:
    """Plans for servers a coordinator holds; profile jobs, if needed, run on them.
    `servers_memory_bytes`: what each of them offers, where `cluster` plans for another
    figure (`interleaf plan --server-memory`): the profile's jobs must fit the servers."""
    given = None if profile_path else ProfileServers(lambda: given_servers(client, cluster.servers), cluster.servers,
                                                     servers_memory_bytes or cluster.memory_bytes,
                                                     cluster.compute_slowdown)
    check_plannable(config, cluster)  # before the profile's jobs on the servers
    profile = obtain_profile(config, device, profile_path=profile_path, log=log, servers=given)
    return search_timed(config, cluster, profile, top, given, log)


@dataclass(frozen=True)
class PlannedRun:
    overrides: list[str]
    """The chosen layout as SECTION.KEY=VALUE, parallel.plan spent."""
    plan: dict
    """The chosen plan as `interleaf plan --json` gives it (RankedPlan.as_json)."""
    config: JobConfig
    """The job's config under that layout."""
    refine: Callable[[str], None]
    """Called with the job's id once it has run: its traced step refines the profile."""


def plan_for_run(client, config: JobConfig, cluster: Cluster, device: str, log) -> PlannedRun:
    """Plans a job about to be submitted through `client`, and prints the choice and why."""
    report, profile = plan_on(client, config, cluster, device, 1, None, log)
    best = report.plans[0]
    log(f"planned: {best.layout.describe()}, predicted {best.step_s:.4f} s a step, bubble {best.bubble:.1%}, "
        f"peak {amount_text(max(best.peak_bytes))} (best of {report.candidates} layouts of "
        f"{cluster.servers} servers" + (f"; {report.unvisited} left unweighed at the search's time budget"
                                        if report.stopped_by_time else "") + ")")
    for line in explain(best):
        log(f"  {line}")
    log(f"  {describe_profile(profile)}")
    return PlannedRun(overrides(best.as_json()), best.as_json(), best.config,
                      lambda job_id: refine_from_job(client, job_id, best.config, profile, cluster))


def refine_from_job(client, job_id: str, config: JobConfig, profile: DeviceProfile, cluster: Cluster) -> None:
    """Feeds a planned job's newest traced step back into its cached profile."""
    try:
        trace = client.trace(job_id)
    except Exception:  # a job that traced nothing (trace.steps=[]) leaves the profile as it was
        return
    if trace.reports:
        plan_profile.store(plan_profile.refine(profile, trace, config, cluster.compute_slowdown),
                           plan_profile.profile_setup(config, profile.device, cluster.memory_bytes))
