"""The planner on real servers: `interleaf plan` against the shared cluster's coordinator
measures the device profile with real jobs, its picks run and equal the single-process
reference, a traced job refines the profile, and `interleaf run --plan auto` plans,
says why, and runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest

from interleaf.clients import plan_command, plan_profile
from interleaf.common.security import TOKEN_ENV
from interleaf.coordinator.config import load_config
from tests.conftest import SERVERS, TINY, layout_free, reference
from tests.test_cli_deployment import _cli, _sets
from tests.test_equivalence import LOSS_RTOL, check_equivalent



@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan-cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(folder)
    yield folder
    if before is None:
        os.environ.pop("XDG_CACHE_HOME")
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture(scope="module")
def plans(cluster, cache):
    """`interleaf plan --json` for the shared cluster's 8 idle servers, measuring first."""
    result = _cli(cluster, "plan", *_sets(TINY), "--top", "4", "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "measuring the device profile" in result.stderr
    assert "chunk shapes of the top" in result.stderr
    assert len(list((cache / "interleaf" / "plan-profiles").glob("*.json"))) == 1
    return json.loads(result.stdout)


def test_server_memory_plans_for_other_servers_but_profiles_these(cluster, plans):
    """`plan --server-memory B` against a coordinator plans for servers of B; its profile
    is (here: was) measured on the coordinator's own servers, at their memory, so the
    cached one is read, though B is too small for any profile job."""
    result = _cli(cluster, "plan", *_sets(TINY), "--server-memory", str(1 << 28), "--top", "1")
    assert "device profile from the cache" in result.stderr and "measuring" not in result.stderr, result.stderr


def test_plan_ranks_layouts_of_the_coordinators_servers(cluster, plans):
    assert len(plans) == 4
    times = [p["predicted_step_seconds"] for p in plans]
    assert times == sorted(times) and times[0] > 0
    for p in plans:
        g = p["parallel"]
        assert g["dp"] * g["tp"] * g["pp"] == SERVERS
        assert 0 < p["predicted_peak_bytes"] < cluster.memory_per_server
    # the second call reads the cache: no profile job runs
    again = _cli(cluster, "plan", *_sets(TINY), "--top", "1")
    assert again.returncode == 0 and "device profile from the cache" in again.stderr
    assert "run the best: --set parallel.dp=" in again.stdout


def test_the_profile_measures_each_group_kinds_links_on_the_servers(cache, plans):
    """The tensor and data-parallel laws come from calls inside the profile's jobs on the
    servers (StepReport.comm), each from two mean call sizes; pipeline messages from the
    pipeline jobs' steps replayed (their latency beyond the probe's bandwidth), and the
    ranks' posting of them from their spans."""
    profile = plan_profile.load_cached(plan_profile.profile_setup(load_config("", TINY), "cpu", None), "cpu")
    for kind in ("tp", "tp_reduce_scatter", "tp_all_gather", "dp", "dp_reduce_scatter", "dp_all_gather"):
        calls = [o for o in profile.observations if o["kind"] == f"link:{kind}"]
        assert len({o["amount"] for o in calls}) >= 2, kind
        assert profile.links[kind].rate > 0 and profile.links[kind].overhead_s >= 0
    assert ("links: dp, dp_all_gather, dp_reduce_scatter, tp, tp_all_gather, tp_reduce_scatter in those jobs, "
            "p2p's latency from their pipeline steps replayed, p2p's bandwidth from two local gloo processes"
            ) in profile.measured_on
    # every traced step of the profile's five pipeline jobs (the shape jobs here are dp=4 or tp>1)
    assert len([o for o in profile.observations if o["kind"] == "message"]) >= 5 * len(plan_profile.TRACED)
    postings = [o for o in profile.observations if o["kind"] == "posting"]
    assert len(postings) > 15 and profile.posting is not None and profile.posting.seconds(postings[0]["amount"]) > 0
    # the selective job's forwards against the plain job's, at the same chunks
    assert {o["amount"] for o in profile.observations if o["kind"] == "forward_selective"}
    assert profile.selective_forward_factor is not None and profile.selective_forward_factor >= 1.0


def test_the_printed_plans_chunk_shapes_were_run_on_the_servers(cache, plans):
    """Each chunk shape of the printed plans was timed on the servers (on a tensor group
    of its size) before the search that printed them, and is priced at what it took."""
    config = load_config("", TINY)
    profile = plan_profile.load_cached(plan_profile.profile_setup(config, "cpu", None), "cpu")
    configs = [load_config("", TINY + plan_command.overrides(p)) for p in plans]
    assert plan_profile.untimed_shapes(configs, profile) == []
    assert "chunk shapes of the top plans in " in profile.measured_on
    timed = [o for o in profile.observations if o["kind"].startswith("shape:")]
    assert {o["shape"] for o in timed} == set(profile.shapes)


@pytest.mark.parametrize("pick", [0, 1])
def test_picked_plans_equal_the_reference(client, tmp_path, plans, pick):
    sets = plan_command.overrides(plans[pick])
    check_equivalent(client, sets, tmp_path)


def test_a_traced_job_refines_the_profile(client, cache, plans):
    config = load_config("", TINY)
    setup = plan_profile.profile_setup(config, "cpu", None)
    before = plan_profile.load_cached(setup, "cpu")
    # a layout with data and tensor groups, whose calls refine their links (its reductions
    # after the backward: one started inside the last backward would hide that backward's
    # tensor calls among the step's, and leave no measure of the shard's compute)
    layout = ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
              "parallel.microbatches=2", "parallel.zero=1", "parallel.scatter_gather=false",
              "parallel.overlap_grad_reduce=false"]
    final = load_config("", TINY + layout)
    status = client.submit("", TINY + layout + ["trace.steps=[1]"])
    done, _ = client.wait(status.job_id, timeout_s=300)
    assert done.state == "SUCCEEDED", done.error
    from interleaf.coordinator.planner.search import Cluster

    plan_command.refine_from_job(client, status.job_id, final, before, Cluster(SERVERS, 1 << 40, SERVERS))
    after = plan_profile.load_cached(setup, "cpu")
    added = after.observations[len(before.observations):]
    assert {"link:tp", "link:dp_reduce_scatter", "link:dp_all_gather", "tp_compute"} <= {
        o["kind"] for o in added}
    assert after.measured_on.endswith("; refined from 1 traced job")
    # each later refinement counts, rather than adding a clause of its own
    again = plan_profile.refine(after, client.trace(status.job_id), final, 1.0)
    assert again.measured_on == after.measured_on.replace("1 traced job", "2 traced jobs")


def test_the_coordinator_refuses_an_unplanned_auto(client):
    with pytest.raises(grpc.RpcError) as refused:
        client.submit("", TINY + ["parallel.plan=auto"])
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "planned before submitting" in refused.value.details()


def test_run_plan_auto_plans_says_why_and_runs(tmp_path, cache):
    """...from a layout no job could run as given (16 pipeline ranks of 8 layers): the
    planner sets it aside."""
    metrics = tmp_path / "m.jsonl"
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "run", "--local", "2", "--plan", "auto",
                             *_sets(TINY + ["parallel.pp=16"]), "--metrics-out", str(metrics)], capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "planned: " in result.stderr and "lower bound" in result.stderr
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    losses = [r["loss"] for r in rows if r.get("kind") == "step"]
    history, _ = reference(layout_free(TINY))
    assert losses == pytest.approx([h.loss for h in history], rel=LOSS_RTOL)


def test_a_plan_whose_checkpoint_init_is_not_here_is_refused_before_submitting(cluster, tmp_path):
    """The config cannot be read here, so it cannot be planned here: said, and nothing
    is submitted (without plan=auto the coordinator answers: test_hf_interop.py)."""
    missing = tmp_path / "not-here"
    for command in (["submit"], ["run", "--plan", "auto"]):
        result = _cli(cluster, *command, "--set", f"checkpoint.init={missing}", "--set", "parallel.plan=auto")
        assert result.returncode == 2, result.stderr
        assert "cannot read the config's checkpoint.init" in result.stderr


def test_a_remote_plan_stopped_by_sigint_cancels_its_profile_job(cluster, client, tmp_path):
    """`interleaf run --plan auto` against a coordinator, interrupted while its profile
    job runs: no job of the user's exists yet, so it says that planning stopped (not that
    a job goes on), cancels the profile job, which frees the servers, and submits none."""
    def servers_idle() -> bool:
        return all(s.state == "IDLE" for s in client.servers())

    _wait_until(servers_idle, 60, "the shared cluster idle")
    env = {**os.environ, TOKEN_ENV: cluster.security.token, "XDG_CACHE_HOME": str(tmp_path)}  # nothing cached
    process = subprocess.Popen([sys.executable, "-m", "interleaf.clients.cli", "run", "--coordinator", cluster.address,
                                "--plan", "auto", *_sets(TINY)], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        _wait_until(lambda: not servers_idle() or process.poll() is not None, 120, "the profile job running")
        assert process.poll() is None, process.communicate()[1]
        process.send_signal(signal.SIGINT)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 128 + signal.SIGINT, err
        assert "SIGINT: planning stopped" in err and "goes on" not in err, err
        _wait_until(servers_idle, 30, "the profile job cancelled",
                    lambda: [(s.state, s.job_id, str(client.status(s.job_id))[:600]) for s in client.servers() if s.job_id])
        time.sleep(1.0)
        assert servers_idle(), "a job was submitted after the stop"
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def _wait_until(condition, timeout_s: float, what: str, details=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s {details()}"
        time.sleep(0.1)
