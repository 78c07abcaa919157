"""The coordinator killed with SIGKILL mid-job and started again on the same address and
state db (issue 10, coordinator restart): the stage servers keep trying to register
while it is gone, register again, let the dead incarnation's job go; the job resumes
from its newest checkpoint and ends with the losses of a run never interrupted, under
its submitted layout though it is elastic and the servers come back one by one (nothing
was lost); ids never repeat; the dead incarnation's calls are refused; the servers take
new jobs."""

from __future__ import annotations

import json
import re
import signal
import time

import grpc
import pytest

from interleaf.clients.follow import MetricsOut, follow
from interleaf.clients.launcher import LocalCluster
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.incarnation import HEADER
from tests.conftest import TINY, layout_free, reference
from tests.test_equivalence import LOSS_RTOL

STEPS = 16
SETTINGS = TINY + [f"train.steps={STEPS}", "parallel.dp=2", "parallel.pp=2", "parallel.vpp=1",
                   "parallel.schedule=1f1b"]
DOWN_S = 3.0  # how long the coordinator stays dead


def _log(logs, name: str) -> str:
    return (logs / f"{name}.log").read_text()


def _watch(client, job_id: str, events: list, until=lambda event: False) -> None:
    """Appends the job's events (replayed, then new) until `until` holds or the stream
    ends; a stream cut by the coordinator's death ends quietly."""
    try:
        for event in client.watch(job_id, timeout_s=300):
            events.append(event)
            if until(event):
                return
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err


def test_a_killed_coordinator_restarts_and_its_job_resumes_with_the_uninterrupted_losses(tmp_path):
    logs = tmp_path / "logs"
    cluster = LocalCluster(4, threads_per_server=1, log_dir=str(logs), steps_per_call=1)
    with cluster:
        client = cluster.client()
        job_id = client.submit("", SETTINGS + [f"checkpoint.dir={tmp_path / 'ckpt'}", "checkpoint.every=2",
                                               "parallel.elastic=true"]).job_id
        before: list[pb.JobEvent] = []
        # Killed once step 5 is reported: the checkpoint of step 4 saved, or under way.
        _watch(client, job_id, before, until=lambda e: e.HasField("step") and e.step.step == 5)
        servers = {r.server_address for r in client.status(job_id).ranks}
        old_incarnation = re.search(r"incarnation (\w+),", _log(logs, "coordinator"))[1]
        cluster.processes[0].send_signal(signal.SIGKILL)
        cluster.processes[0].wait()
        client.close()
        killed = time.monotonic()

        # Gone for a while: every server keeps trying to reach it (one try a second).
        time.sleep(DOWN_S)
        for i in range(4):
            tries = _log(logs, f"stage-server-{i}").count("coordinator unreachable for")
            assert tries >= DOWN_S - 1, (i, tries)
        restarted = time.time()
        cluster.restart_coordinator()
        client = cluster.client()
        deadline = time.monotonic() + 30  # logged just after it starts listening
        while len(incarnations := re.findall(r"incarnation (\w+),", _log(logs, "coordinator"))) < 2:
            assert time.monotonic() < deadline, "the restarted coordinator logged no incarnation"
            time.sleep(0.1)
        new_incarnation = incarnations[-1]
        assert new_incarnation != old_incarnation

        # Known by its id at once, recovering, its history replayed, and its traced step
        # (trace.steps' default: the second and the last) from before the kill served.
        status = client.status(job_id)
        assert status.state in ("RECOVERING", "SETTING_UP", "RUNNING"), status
        trace = client.trace(job_id, 1)
        assert (trace.step, sorted(r.rank for r in trace.reports)) == (1, [0, 1, 2, 3])
        assert all(r.spans for r in trace.reports)
        after: list[pb.JobEvent] = []
        _watch(client, job_id, after, until=lambda e: e.HasField("recovery"))
        (recovery,) = [e.recovery for e in after if e.HasField("recovery")]
        running = time.time()
        # The dead incarnation can no longer drive the job on the servers that now hold it.
        for address in sorted(servers):
            channel = wire.channel(address, cluster.security)
            with pytest.raises(grpc.RpcError) as refused:
                rpc.StageServerStub(channel).Teardown(pb.JobRef(job_id=job_id), timeout=10,
                                                      metadata=[(HEADER, old_incarnation)])
            channel.close()
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, address
            assert f"belongs to coordinator incarnation {new_incarnation!r}" in refused.value.details()
        _watch(client, job_id, after)
        final = client.status(job_id)
        assert final.state == "SUCCEEDED", final.error

        reasons = [e.status.reason for e in after if e.HasField("status") and e.status.state == "RECOVERING"]
        assert reasons and reasons[-1].startswith("coordinator restarted (the job was RUNNING at step")
        assert recovery.attempt == 0 and recovery.failure == "the coordinator restarted" and not recovery.lost
        # Its newest complete checkpoint: the newest saved in its history before the kill
        # (step 6's save may have completed before the kill, or not).
        resumed_at = next(i for i, e in enumerate(after) if e.HasField("status") and e.status.state == "RECOVERING")
        saved = [e.checkpoint.step for e in after[:resumed_at] if e.HasField("checkpoint") and
                 e.checkpoint.kind == "saved"]
        assert saved and recovery.restart_step == max(saved), (recovery.restart_step, saved)
        # Elastic, yet under the submitted layout: a restart loses no server, so it
        # waits for all four rather than shrink to the first two that register again.
        assert (recovery.grid.dp, recovery.grid.pp, recovery.microbatches) == (2, 2, 4) and not recovery.resized
        assert len(final.ranks) == 4
        # --metrics-out of the job's history, replayed: the recovery is a row of its own kind.
        metrics = MetricsOut(str(tmp_path / "m.jsonl"))
        assert follow(client, job_id, STEPS, metrics) == 0
        metrics.close()
        rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
        assert {r["kind"] for r in rows} == {"step", "checkpoint", "recovery"}
        assert [r for r in rows if r["kind"] == "recovery"] == [{
            "kind": "recovery", "attempt": 0, "failure": "the coordinator restarted", "lost": [],
            "step": recovery.restart_step, "recover_seconds": recovery.recover_seconds, "dp": 2, "pp": 2, "tp": 1,
            "microbatches": 4, "resized": ""}]
        print(f"coordinator down {DOWN_S:.0f} s; job running again {running - restarted:.2f} s after the restart "
              f"(process start included; {recovery.recover_seconds:.2f} s after the coordinator resumed it), "
              f"from step {recovery.restart_step}; {time.monotonic() - killed:.1f} s from kill to the end")
        assert running - restarted < 60

        # Every step's last report is the uninterrupted run's.
        history, _ = reference(layout_free(SETTINGS))
        last = {e.step.step: e.step for e in before + after if e.HasField("step")}
        assert sorted(last) == list(range(STEPS))
        for step, got in last.items():
            assert got.loss == pytest.approx(history[step].loss, rel=LOSS_RTOL), step
            assert got.grad_norm == pytest.approx(history[step].grad_norm, rel=LOSS_RTOL), step

        # The servers let the dead incarnation's job go and take the next job, whose id
        # is new: numbers continue from the state db.
        following = client.submit("", SETTINGS + ["train.steps=3"]).job_id
        assert int(following.split("-")[1]) == int(job_id.split("-")[1]) + 1
        final, steps = client.wait(following, timeout_s=120)
        assert final.state == "SUCCEEDED", final.error
        assert len(steps) == 3
        client.close()
