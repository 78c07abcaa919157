"""parallel.elastic (issue 10): a job that loses a stage server with no spare registered
goes on at once with fewer data-parallel replicas and proportionally more microbatches,
from its newest checkpoint, and every step's loss and gradient norm stay the
uninterrupted run's. First the pure parts (which layouts, which samples), then SIGKILL
of a server of real running jobs with no spare."""

from __future__ import annotations

import re
import signal
import time

import numpy as np
import pytest
import torch

from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.elastic import smaller_layouts
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
