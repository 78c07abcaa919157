"""parallel.elastic (issue 10): a job that loses a stage server with no spare registered
goes on at once with fewer data-parallel replicas and proportionally more microbatches,
from its newest checkpoint, and every step's loss and gradient norm stay the
uninterrupted run's. Issue 21: once enough servers are free again it grows back to its
submitted layout at a checkpoint boundary, losses unchanged. First the pure parts (which
layouts, which samples, which boundaries, which servers), then SIGKILL of a server of
real running jobs with no spare, and a shrunk job growing back."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import time
import urllib.request
from functools import partial

import numpy as np
import pytest
import torch

from prometheus_client.parser import text_string_to_metric_families

from interleaf.clients.api import Grow, Job
from interleaf.clients.follow import MetricsOut, follow
from interleaf.coordinator.admission import needed_bytes
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.elastic import grows_back, smaller_layouts
from interleaf.coordinator.plan import place_servers, plan_programs
from interleaf.coordinator.registry import Registry
from interleaf.stageserver.data import Sampler, resolve_source, write_tokens
from tests.conftest import TINY, layout_free, reference, servers_by_address
from tests.test_equivalence import LOSS_RTOL

STEPS = 12


# --- which samples -------------------------------------------------------------------

def test_every_smaller_layout_trains_on_the_submitted_layouts_samples(tmp_path):
    """A step's samples depend on no layout knob (stageserver/data/sampler.py), so the
    layouts an elastic job may shrink to hold them all, each split its own way: every
    replica's slice of every microbatch, concatenated, is the submitted layout's step."""
    path = tmp_path / "random.tokens"
    write_tokens(path, np.random.default_rng(3).integers(0, 256, size=5000))
    source = resolve_source(str(path))
    config = load_config("", ["parallel.dp=4", "parallel.microbatches=4", "train.global_batch=16",
                              "parallel.elastic=true"])

    def step_rows(c, step=5):
        p, t = c.parallel, c.train
        sampler = Sampler(source, t.seed, 16, t.global_batch, p.microbatches)
        return torch.cat([sampler.microbatch(step, j, d, p.dp)[0]
                          for j in range(p.microbatches) for d in range(p.dp)])

    whole = step_rows(config)
    assert whole.shape == (16, 16)
    smaller = smaller_layouts(config)
    assert [(c.parallel.dp, c.parallel.microbatches) for c in smaller] == [(2, 8), (1, 16)]
    for c in smaller:
        assert torch.equal(step_rows(c), whole), c.parallel
    assert not torch.equal(step_rows(config, step=6), whole)  # another step


# --- which layouts -------------------------------------------------------------------

def _layouts(*overrides):
    config = load_config("", list(overrides))
    found = smaller_layouts(config)
    for smaller in found:  # everything else is the submitted job's
        assert smaller.train == config.train and smaller.model == config.model
        assert (smaller.parallel.tp, smaller.parallel.pp, smaller.parallel.vpp, smaller.parallel.zero) == \
            (config.parallel.tp, config.parallel.pp, config.parallel.vpp, config.parallel.zero)
        assert smaller.parallel.dp * smaller.parallel.microbatches == config.parallel.dp * config.parallel.microbatches
        assert not smaller.parallel.elastic
    return [(c.parallel.dp, c.parallel.microbatches) for c in found]


def test_smaller_layouts_trade_replicas_for_microbatches_largest_first():
    assert _layouts("parallel.dp=4", "parallel.microbatches=4", "train.global_batch=16",
                    "parallel.elastic=true") == [(2, 8), (1, 16)]  # 3 does not divide 16
    assert _layouts("parallel.dp=6", "parallel.microbatches=2", "train.global_batch=12", "parallel.pp=1",
                    "parallel.vpp=1", "parallel.schedule=1f1b") == [(4, 3), (3, 4), (2, 6), (1, 12)]


def test_smaller_layouts_keep_the_schedules_rules():
    # interleaved-1f1b needs microbatches a multiple of pp=2: dp'=2 would run 3.
    assert _layouts("parallel.dp=3", "parallel.microbatches=2", "train.global_batch=6") == [(1, 6)]
    # 1f1b has no such rule.
    assert _layouts("parallel.dp=3", "parallel.microbatches=2", "train.global_batch=6", "parallel.vpp=1",
                    "parallel.schedule=1f1b") == [(2, 3), (1, 6)]


@pytest.mark.parametrize("overrides,message", [
    (["parallel.elastic=true"], "parallel.elastic=true needs parallel.dp>=2 (dp=1 has no smaller"),
    (["parallel.dp=2", "parallel.elastic=yes"], "parallel.elastic='yes' must be true or false"),
    # dp'=1 would run 8192 microbatches, beyond common/limits.py's bound.
    (["parallel.dp=2", "parallel.microbatches=4096", "train.global_batch=8192", "parallel.pp=1", "parallel.vpp=1",
      "parallel.schedule=1f1b", "parallel.elastic=true"],
     "parallel.elastic=true needs a smaller layout to go on with, and parallel.dp=2 with "
     "parallel.microbatches=4096 has none: every dp' < 2 dividing dp*microbatches=8192 breaks a rule "
     "(dp'=1: parallel.microbatches=8192 must be at most 4096)"),
    # dp'=1 would plan pp*vpp*microbatches=32768 pipeline slots.
    (["parallel.dp=2", "parallel.pp=4", "parallel.vpp=2", "parallel.microbatches=2048", "train.global_batch=4096",
      "model.n_layers=8", "parallel.elastic=true"],
     "(dp'=1: parallel.pp*parallel.vpp*parallel.microbatches=32768 must be at most 16384"),
])
def test_elastic_is_validated_at_submit(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config("", overrides)
    assert load_config("[parallel]\ndp = 2\nelastic = true\n").parallel.elastic
    with pytest.raises(ConfigError, match=re.escape("parallel.elastic=1 must be true or false")):
        load_config("[parallel]\ndp = 2\nelastic = 1\n")


# --- a server killed with no spare ---------------------------------------------------

@pytest.fixture(scope="module")
def no_spares(tmp_path_factory):
    """A coordinator and four servers, each process known by its address."""
    with servers_by_address(tmp_path_factory.mktemp("elastic-logs")) as cluster:
        yield cluster


@pytest.mark.parametrize("layout,victim_rank,after,what", [
    # 4 servers, one killed: the 3 left hold dp=1 with pp=2 (2 servers), 8 microbatches
    # (a multiple of pp, as interleaved-1f1b needs).
    (["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2"], 3, (1, 2, 1, 8), "dp2·pp2 interleaved -> dp1"),
    # 4 servers, one killed: dp=1 with tp=2 and 8 microbatches, ZeRO-1's optimizer
    # shards resharded from 2 replicas to 1.
    (["parallel.dp=2", "parallel.tp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
      "parallel.zero=1"], 2, (1, 1, 2, 8), "dp2·tp2 ZeRO-1 -> dp1"),
])
def test_a_killed_server_with_no_spare_shrinks_dp_and_keeps_the_losses(no_spares, tmp_path, layout, victim_rank,
                                                                       after, what):
    cluster, client, by_address = no_spares
    settings = TINY + [f"train.steps={STEPS}"] + layout
    status = client.submit("", settings + ["parallel.elastic=true", f"checkpoint.dir={tmp_path}",
                                           "checkpoint.every=3"])
    events, killed = [], {}
    for event in client.watch(status.job_id, timeout_s=300):
        events.append(event)
        # Kill once the checkpoint of step 3 is saved and step 4 is under way.
        if not killed and event.HasField("step") and event.step.step == 4:
            address = client.status(status.job_id).ranks[victim_rank].server_address
            by_address[address].send_signal(signal.SIGKILL)
            killed.update(address=address, at=time.time())
    final = client.status(status.job_id)
    # A replacement for the next case (not while a watch is in flight: the launcher forks).
    process, address = cluster.add_server()
    by_address[address] = process
    assert final.state == "SUCCEEDED", final.error
    assert killed, "the victim was never killed"

    dp, pp, tp, microbatches = after  # what the job goes on with
    (recovery,) = [e.recovery for e in events if e.HasField("recovery")]
    assert list(recovery.lost) == [killed["address"]] and recovery.attempt == 1
    assert (recovery.grid.dp, recovery.grid.pp, recovery.grid.tp, recovery.microbatches) == (dp, pp, tp, microbatches)
    assert recovery.resized.startswith(f"parallel.elastic: dp={dp}, microbatches={microbatches}"), recovery.resized
    assert len(final.ranks) == dp * pp * tp  # still dp' at the end
    statuses = [e.status for e in events if e.HasField("status")]
    assert [s.state for s in statuses].count("RECOVERING") == 1
    running_again = [s for s in statuses if s.state == "RUNNING"][-1]
    assert running_again.reason == recovery.resized
    assert f"over dp={dp}" in running_again.layout  # the ZeRO line names the new dp
    detection = recovery.detected_unix - killed["at"]
    print(f"{what}: detected {detection:.2f} s after the kill, running again at dp={dp} with "
          f"{microbatches} microbatches {recovery.recover_seconds:.2f} s later (from step {recovery.restart_step})")
    assert 0 <= detection < 10 and recovery.recover_seconds < 60
    assert recovery.restart_step in (3, 6)

    # The last report of each step (steps after the checkpoint ran twice) is the reference's.
    history, _ = reference(layout_free(settings))
    last = {e.step.step: e.step for e in events if e.HasField("step")}
    assert sorted(last) == list(range(STEPS))
    worst = 0.0
    for step, got in last.items():
        assert got.loss == pytest.approx(history[step].loss, rel=LOSS_RTOL), step
        assert got.grad_norm == pytest.approx(history[step].grad_norm, rel=LOSS_RTOL), step
        worst = max(worst, abs(got.loss - history[step].loss) / abs(history[step].loss),
                    abs(got.grad_norm - history[step].grad_norm) / abs(history[step].grad_norm))
    print(f"{what}: largest relative difference from the reference (loss, grad norm) {worst:.2e}")


# --- growing back: when, and onto which servers --------------------------------------

def test_a_shrunk_job_grows_back_only_at_a_checkpoint_boundary_before_its_end():
    config = load_config("", ["parallel.dp=4", "parallel.microbatches=4", "train.global_batch=16", "train.steps=12",
                              "parallel.elastic=true", "checkpoint.dir=/tmp/unused", "checkpoint.every=3"])
    shrunk = smaller_layouts(config)[0]
    # The grown layout resumes from the boundary's checkpoint: no step runs twice. The
    # step-12 boundary is the job's end, with nothing left to run.
    assert [step for step in range(13) if grows_back(config, shrunk, step)] == [3, 6, 9]
    assert not any(grows_back(config, config, step) for step in range(13))  # not shrunk
    at_end_only = dataclasses.replace(config, checkpoint=dataclasses.replace(config.checkpoint, every=0))
    assert not any(grows_back(at_end_only, shrunk, step) for step in range(13))  # no boundary to grow at


def test_a_growth_claim_takes_the_jobs_own_and_idle_servers_never_another_jobs_nor_too_small_ones():
    """The driver's claim at a boundary (JobDriver._claim_growth): placement and
    admission of the submitted layout over the idle servers and the job's own, under the
    registry's lock, without waiting."""
    config = load_config("", TINY + ["parallel.dp=2", "parallel.pp=2", "parallel.elastic=true"])
    need = max(needed_bytes(config, plan_programs(config)[0]))
    grow = partial(place_servers, config, need_bytes=need)
    registry = Registry()
    ids = {name: registry.register(f"127.0.0.1:{port}", "", "cpu", 2 * need)
           for name, port in (("a", 1), ("b", 2), ("c", 3), ("d", 4))}

    def take(job, names):  # claims exactly these servers for `job`
        picked = registry.claim(job, lambda idle: [s for s in idle if s.server_id in {ids[n] for n in names}],
                                timeout_s=0.0)
        assert {s.server_id for s in picked} == {ids[n] for n in names}

    take("shrunk", "ab")
    take("other", "c")
    # Its 2, one idle, and one of another job: 4 live servers, 3 to be had.
    assert registry.claim("shrunk", grow, timeout_s=0.0, own=True) is None
    # A server that registers offering too little for the layout's ranks is not enough.
    registry.register("127.0.0.1:5", "", "cpu", need - 1)
    assert registry.claim("shrunk", grow, timeout_s=0.0, own=True) is None
    ids["e"] = registry.register("127.0.0.1:6", "", "cpu", need)
    # A queued job waiting for 4 servers (3 are idle) goes first: no growth meanwhile.
    assert registry.claim("queued", lambda idle: idle if len(idle) >= 4 else None, timeout_s=0.05) is None
    assert registry.claim("shrunk", grow, timeout_s=0.0, own=True) is None
    registry.release("queued")  # it was cancelled
    slots = registry.claim("shrunk", grow, timeout_s=0.0, own=True)
    assert {s.server_id for s in slots} == {ids[n] for n in "abde"}
    holders = {e.server_id: e.job_id for e in registry.servers()}
    assert [holders[ids[n]] for n in "abcde"] == ["shrunk"] * 2 + ["other"] + ["shrunk"] * 2
    # Those of its own the grown layout did not choose are freed once its attempt is down.
    registry.release("shrunk", keep=frozenset(ids[n] for n in "ade"))
    holders = {e.server_id: e.job_id for e in registry.servers()}
    assert [holders[ids[n]] for n in "abcde"] == ["shrunk", "", "other", "shrunk", "shrunk"]


def _metric(address: str, name: str, job: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    found = [s.value for family in text_string_to_metric_families(text) for s in family.samples
             if s.name == name and s.labels.get("job") == job]
    assert len(found) == 1, (name, found)
    return found[0]


def _poll(client, job_id: str, until, what: str, timeout_s: float = 120.0):
    """The job's status, asked every 50 ms until `until(status)`: the test acts on two
    jobs at chosen steps of one, which a watch of either would not follow."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = client.status(job_id)
        if until(status):
            return status
        assert status.state in ("PENDING", "SETTING_UP", "RUNNING", "RECOVERING"), (what, status.state, status.error)
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s (job at step {status.step}, {status.state})")


GROW_STEPS = 24


def _saved_step(status) -> int:
    found = re.search(r"step-(\d+)", status.checkpoint)
    return int(found[1]) if found else -1


def test_a_shrunk_job_grows_back_when_servers_are_free_and_keeps_the_losses(no_spares, tmp_path):
    """5 servers: a job of another user holds one, the elastic job (dp=2·pp=2, ZeRO-1)
    the other 4. One of its servers is killed during step 3: it goes on from the
    checkpoint of step 2 at dp=1 with 8 microbatches, one server idle. At the step-4
    boundary it cannot grow: the only other live server is the other job's. That job is
    cancelled; at a later boundary the elastic job takes the idle server and the freed
    one, grows back to dp=2 from that boundary's checkpoint (ZeRO-1's optimizer shards
    resharded from 1 replica to 2), and every step's loss is the uninterrupted run's.
    The elastic job grows at the first boundary after the other job's servers are
    freed (they are, before its final state is published); a cancel takes about a
    second, so the job runs long enough (24 steps, a boundary every 2) to have one left."""
    cluster, client, by_address = no_spares
    process, address = cluster.add_server()  # the other job's (4 are up: no_spares')
    by_address[address] = process
    other = client.submit("", ["model.n_layers=1", "model.d_model=8", "model.n_heads=1", "model.seq_len=8",
                               "model.vocab_size=256", "train.global_batch=1", "parallel.microbatches=1",
                               "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b", "train.steps=1000000"])
    other_server = _poll(client, other.job_id, lambda s: s.state == "RUNNING", "the other job runs"
                         ).ranks[0].server_address

    layout = ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=1"]
    settings = TINY + [f"train.steps={GROW_STEPS}"] + layout
    job = client.submit("", settings + ["parallel.elastic=true", f"checkpoint.dir={tmp_path}",
                                        "checkpoint.every=2"]).job_id
    running = _poll(client, job, lambda s: s.step >= 3 and _saved_step(s) == 2, "the checkpoint of step 2")
    assert len(running.ranks) == 4
    victim = running.ranks[3].server_address
    by_address[victim].send_signal(signal.SIGKILL)
    # Past the step-4 boundary at dp=1 (2 servers), the other job still holding its server.
    shrunk = _poll(client, job, lambda s: s.state == "RUNNING" and len(s.ranks) == 2 and s.step >= 5,
                   "past the step-4 boundary after shrinking")
    assert _saved_step(shrunk) >= 4 and client.status(other.job_id).state == "RUNNING"
    client.cancel(other.job_id)
    # Its servers are free before its final state is published.
    _poll(client, other.job_id, lambda s: s.state == "CANCELLED", "the other job's cancel")
    freed = client.status(job).step  # the elastic job's steps done once that server was free, at the latest
    assert freed < GROW_STEPS - 2, f"the other job's server was freed only at step {freed}: no boundary left"

    events = list(client.watch(job, timeout_s=300))
    final = client.status(job)
    assert final.state == "SUCCEEDED", final.error
    (recovery,) = [e.recovery for e in events if e.HasField("recovery")]
    assert list(recovery.lost) == [victim] and recovery.restart_step == 2
    assert recovery.resized.startswith("parallel.elastic: dp=1, microbatches=8"), recovery.resized
    (grow,) = [e.grow for e in events if e.HasField("grow")]
    # The next boundary once the server was free: after `freed` steps at the latest (at
    # `freed` itself when that is a boundary whose claim came after the release).
    assert grow.step % 2 == 0 and 6 <= grow.step <= freed - freed % 2 + 2, (grow.step, freed)
    assert (grow.grid.dp, grow.grid.pp, grow.grid.tp, grow.microbatches) == (2, 2, 1, 4)
    assert (grow.before.dp, grow.before.pp, grow.before.tp, grow.before_microbatches) == (1, 2, 1, 8)
    # The idle survivor and the other job's server, freed: 2 more than the 2 it held.
    assert len(grow.added) == 2 and other_server in grow.added and victim not in grow.added
    assert grow.reason.startswith(f"parallel.elastic: grew back to the submitted dp=2, microbatches=4 on 4 "
                                  f"servers at the checkpoint of step {grow.step} (from dp=1, microbatches=8"), \
        grow.reason
    statuses = [e.status for e in events if e.HasField("status")]
    assert [s.reason for s in statuses if s.state == "RUNNING"][-1] == grow.reason
    assert [s.state for s in statuses].count("RECOVERING") == 1  # a growth is no recovery
    assert len(final.ranks) == 4
    resumed = [e.checkpoint.step for e in events if e.HasField("checkpoint") and e.checkpoint.kind == "resumed"]
    assert resumed == [2, grow.step]
    print(f"grew back at step {grow.step} (the other job's server free after step {freed - 1} at the latest) "
          f"in {grow.seconds:.2f} s (teardown, setup, resume)")
    assert grow.seconds < 60

    # Each step's world: 4 ranks before the kill, 2 after the shrink, 4 from the growth
    # on; no step from 4 on ran twice (the growth resumed where it stopped: only steps
    # the kill interrupted ran again), and the last report of each step is the reference's.
    reports = [e.step for e in events if e.HasField("step")]
    last = {r.step: r for r in reports}
    assert sorted(last) == list(range(GROW_STEPS))
    for step, got in last.items():
        assert len(got.ranks) == (2 if 2 <= step < grow.step else 4), step
    assert all([r.step for r in reports].count(step) == 1 for step in range(4, GROW_STEPS))
    history, _ = reference(layout_free(settings))
    worst = 0.0
    for step, got in last.items():
        assert got.loss == pytest.approx(history[step].loss, rel=LOSS_RTOL), step
        assert got.grad_norm == pytest.approx(history[step].grad_norm, rel=LOSS_RTOL), step
        worst = max(worst, abs(got.loss - history[step].loss) / abs(history[step].loss),
                    abs(got.grad_norm - history[step].grad_norm) / abs(history[step].grad_norm))
    print(f"shrunk and grown back: largest relative difference from the reference (loss, grad norm) {worst:.2e}")

    # What a user sees: the coordinator's metrics, the Python API's events and
    # `interleaf watch --metrics-out`.
    assert _metric(cluster.http_address, "interleaf_data_parallel_replicas", job) == 2
    assert _metric(cluster.http_address, "interleaf_elastic_shrinks_total", job) == 1
    assert _metric(cluster.http_address, "interleaf_elastic_grows_total", job) == 1
    (seen,) = [e for e in Job(client, job).events(timeout_s=60) if isinstance(e, Grow)]
    assert (seen.step, seen.dp, seen.microbatches, seen.before_dp, seen.before_microbatches, seen.added) == \
        (grow.step, 2, 4, 1, 8, tuple(grow.added))
    out = tmp_path / "metrics.jsonl"
    metrics = MetricsOut(str(out))
    assert follow(client, job, GROW_STEPS, metrics) == 0
    metrics.close()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    changes = [r for r in rows if r["kind"] in ("recovery", "grow")]  # the layouts it went on with
    assert [(r["kind"], r["step"], r["dp"], r["pp"], r["tp"], r["microbatches"]) for r in changes] == \
        [("recovery", 2, 1, 2, 1, 8), ("grow", grow.step, 2, 2, 1, 4)]
    assert changes[0]["resized"] == recovery.resized
    assert (changes[1]["from_dp"], changes[1]["from_microbatches"], changes[1]["added"], changes[1]["reason"]) == \
        (1, 8, list(grow.added), grow.reason)
