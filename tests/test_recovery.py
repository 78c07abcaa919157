"""A stage server killed with SIGKILL mid-step: the job detects it, goes to RECOVERING,
sets up again on a spare server, continues from its newest checkpoint and ends with
the losses of a run never interrupted (issue 10, recovery)."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.conftest import TINY, layout_free, reference, servers_by_address
from tests.test_equivalence import LOSS_RTOL

STEPS = 12


@pytest.fixture(scope="module")
def spares(tmp_path_factory):
    """A coordinator and four servers, each process known by its address."""
    with servers_by_address(tmp_path_factory.mktemp("recovery-logs")) as spares:
        yield spares


@pytest.mark.parametrize("layout,victim_rank,what", [
    (["parallel.pp=3", "parallel.vpp=1", "parallel.schedule=1f1b"], 1, "a pipeline middle stage"),
    (["parallel.tp=2", "parallel.pp=1", "parallel.vpp=1"], 1, "a tensor-parallel rank"),
])
def test_a_killed_server_is_replaced_and_the_losses_are_the_uninterrupted_runs(spares, tmp_path, layout,
                                                                               victim_rank, what):
    cluster, client, by_address = spares
    settings = TINY + [f"train.steps={STEPS}", "model.n_layers=6"] + layout
    status = client.submit("", settings + [f"checkpoint.dir={tmp_path}", "checkpoint.every=3"])
    events, killed = [], {}

    def follow():
        for event in client.watch(status.job_id, timeout_s=300):
            events.append(event)
            # Kill once the checkpoint of step 3 is saved and step 4 is under way.
            if not killed and event.HasField("step") and event.step.step == 4:
                address = client.status(status.job_id).ranks[victim_rank].server_address
                by_address[address].send_signal(signal.SIGKILL)
                killed.update(address=address, at=time.time())

    watcher = threading.Thread(target=follow)
    watcher.start()
    watcher.join(timeout=300)
    final = client.status(status.job_id)
    assert final.state == "SUCCEEDED", final.error
    assert killed, "the victim was never killed"

    states = [e.status.state for e in events if e.HasField("status")]
    assert states.count("RECOVERING") == 1 and states[-1] == "SUCCEEDED"
    recovering = next(e.status for e in events if e.HasField("status") and e.status.state == "RECOVERING")
    assert killed["address"] in recovering.reason
    (recovery,) = [e.recovery for e in events if e.HasField("recovery")]
    assert list(recovery.lost) == [killed["address"]] and recovery.attempt == 1
    assert recovery.restart_step in (3, 6)  # the newest complete checkpoint when it was lost
    detection = recovery.detected_unix - killed["at"]
    print(f"{what}: detected {detection:.2f} s after the kill, running again {recovery.recover_seconds:.2f} s later")
    assert 0 <= detection < 10 and recovery.recover_seconds < 60

    # The last report of each step (steps after the checkpoint ran twice) is the reference's.
    history, _ = reference(layout_free(settings))
    last = {e.step.step: e.step for e in events if e.HasField("step")}
    assert sorted(last) == list(range(STEPS))
    for step, got in last.items():
        assert got.loss == pytest.approx(history[step].loss, rel=LOSS_RTOL), step
        assert got.grad_norm == pytest.approx(history[step].grad_norm, rel=LOSS_RTOL), step

    # A replacement for the next case.
    process, address = cluster.add_server()
    by_address[address] = process


def test_no_recovery_without_a_lost_server_and_none_when_max_restarts_is_0(spares, tmp_path):
    cluster, client, by_address = spares
    settings = TINY + ["train.steps=8", "parallel.pp=1", "parallel.vpp=1", "parallel.dp=2"]
    # A diverging job loses no server: it fails, with no recovery.
    status = client.submit("", settings + ["train.lr=1e30", "train.warmup_steps=0"])
    final, _ = client.wait(status.job_id, timeout_s=120)
    assert final.state == "FAILED" and "non-finite" in final.error
    events = list(client.watch(status.job_id, timeout_s=30))
    assert not [e for e in events if e.HasField("status") and e.status.state == "RECOVERING"]

    # With recovery.max_restarts=0 a lost server fails the job.
    status = client.submit("", settings + ["recovery.max_restarts=0"])
    states = []
    for event in client.watch(status.job_id, timeout_s=120):
        if event.HasField("status"):
            states.append(event.status.state)
        if event.HasField("step") and event.step.step == 2:
            by_address[client.status(status.job_id).ranks[0].server_address].send_signal(signal.SIGKILL)
    final = client.status(status.job_id)
    assert final.state == "FAILED" and "RECOVERING" not in states
    assert final.error.startswith("rank "), final.error  # the failed call, naming its rank
    process, address = cluster.add_server()
    by_address[address] = process


@pytest.mark.parametrize("every,progress_timeout_s,found_by,within", [
    # A progress deadline (2 s, or ten times the slowest step when longer: 2.1 s seen on a
    # loaded machine) shorter than the heartbeats' 5 s: no rank finishes a step within
    # it, before the heartbeats say anything.
    (3, 2, "no progress: no rank finished a step within", (1.5, 5)),  # timed from the last report
    # A long progress deadline: the stopped server's missed heartbeats (one a second, dead
    # after 5 s of silence) find it, whether the driver then waits for steps or for the
    # stopped server's part of a save (every=2 puts one right after the stop).
    (2, 60, "stopped heartbeating: none for 5 s", (4, 8)),  # the last heartbeat came up to 1 s before
])
def test_a_hung_server_is_found_and_replaced(spares, tmp_path, every, progress_timeout_s, found_by, within):
    """SIGSTOP: the process is alive and its sockets open, so no call fails by itself.
    The job finds it by its progress deadline or the server's missed heartbeats, the
    stopped server answers nothing and is lost, and the job recovers on a spare."""
    cluster, client, by_address = spares
    settings = TINY + ["train.steps=8", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]
    status = client.submit("", settings + [f"checkpoint.dir={tmp_path}", f"checkpoint.every={every}",
                                           f"recovery.progress_timeout_s={progress_timeout_s}"])
    events, stopped = [], {}
    for event in client.watch(status.job_id, timeout_s=300):
        events.append(event)
        if not stopped and event.HasField("step") and event.step.step == 3:
            address = client.status(status.job_id).ranks[1].server_address
            by_address[address].send_signal(signal.SIGSTOP)
            stopped.update(address=address, at=time.time())
    try:
        final = client.status(status.job_id)
        assert final.state == "SUCCEEDED", final.error
        (recovery,) = [e.recovery for e in events if e.HasField("recovery")]
        assert list(recovery.lost) == [stopped["address"]]
        assert found_by in recovery.failure, recovery.failure
        detection = recovery.detected_unix - stopped["at"]
        print(f"a hung server ({found_by}): detected {detection:.2f} s after SIGSTOP, running again "
              f"{recovery.recover_seconds:.2f} s later")
        assert within[0] <= detection < within[1]
        history, _ = reference(layout_free(settings))
        last = {e.step.step: e.step for e in events if e.HasField("step")}
        assert sorted(last) == list(range(8))
        for step, got in last.items():
            assert got.loss == pytest.approx(history[step].loss, rel=LOSS_RTOL), step
    finally:
        by_address[stopped["address"]].kill()
        by_address[stopped["address"]].wait()
    process, address = cluster.add_server()
    by_address[address] = process
