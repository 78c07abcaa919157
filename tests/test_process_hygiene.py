"""Processes never outlive their purpose (DESIGN.md, "Failures"), shown with real
processes and real signals: `interleaf run --local` stopped by SIGTERM, SIGHUP or SIGKILL
leaves nothing running; a stage server whose coordinator is gone drops its job; a busy
stage server given SIGTERM ends within its bound."""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch.distributed as dist

from interleaf.clients.client import Client
from interleaf.clients.launcher import LocalCluster
from interleaf.protos import interleaf_pb2 as pb
from interleaf.common.security import TOKEN_ENV
from interleaf.stageserver.main import EXIT_BOUND_S, EXIT_GRACE_S
from interleaf.stageserver.service import StageServerService
from tests.conftest import TINY
from tests.test_group_ids import _connect, _setup, _teardown, serve_in_process
from tests.test_launcher import SMALL, _marked_processes, _start

LAYOUT = ["parallel.pp=2", "parallel.vpp=1"]
RUN_GONE_S = 10.0
"""`interleaf run` and every process it started are gone this long after SIGTERM or
SIGHUP (its stop kills what is left at 10 s; measured about 2.5 s). After SIGKILL its
children are gone within EXIT_BOUND_S (the servers' bound; measured under 2 s)."""
SLACK_S = 2.0
"""Allowance for two loaded cores on top of a stated bound."""
ORPHAN_TIMEOUT_S = 3.0


def _wait_until(condition, timeout_s: float, what: str, poll_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while not (result := condition()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(poll_s)
    return result


def _lines(path: pathlib.Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def test_run_stopped_by_sigterm_sighup_or_sigkill_leaves_nothing(tmp_path):
    # The three runs go side by side: each waits mostly on its processes' start.
    runs = {}
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGKILL):
        marker, metrics = uuid.uuid4().hex, tmp_path / f"{sig.name}.jsonl"
        process = _start(["run", *SMALL, "--set", "train.steps=100000", "--metrics-out", str(metrics),
                          "--log-dir", str(tmp_path / sig.name)], marker)
        runs[sig] = (marker, metrics, process)
    try:
        for sig, (marker, metrics, process) in runs.items():
            _wait_until(lambda: _lines(metrics) >= 1 or process.poll() is not None, 240, f"{sig.name} run training")
            assert process.poll() is None, process.communicate()[1]
            assert len(_marked_processes(marker)) == 4  # interleaf run, a coordinator, two servers
        sent = {}
        for sig, (_, _, process) in runs.items():
            process.send_signal(sig)
            sent[sig] = time.monotonic()
        for sig, (marker, _, process) in runs.items():
            bound = (EXIT_BOUND_S if sig is signal.SIGKILL else RUN_GONE_S) + SLACK_S
            _, err = process.communicate(timeout=bound)
            if sig is signal.SIGKILL:
                assert process.returncode == -signal.SIGKILL
            else:
                assert process.returncode == 128 + sig, err
                assert f"{sig.name}: stopping the local servers" in err
            _wait_until(lambda: not _marked_processes(marker), bound - (time.monotonic() - sent[sig]),
                        f"every process of the run stopped by {sig.name} gone")
    finally:
        for _, _, process in runs.values():
            if process.poll() is None:
                process.kill()
                process.communicate()


@contextlib.contextmanager
def _cluster(tmp_path, orphan_timeout_s: float | None = None, steps_per_call: int | None = None):
    extra = ["--orphan-timeout", str(orphan_timeout_s)] if orphan_timeout_s else []
    cluster = LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path), steps_per_call=steps_per_call,
                           server_command=lambda i, command: command + extra)
    with cluster:
        try:
            yield cluster
        finally:
            for process in cluster.processes:  # none left stopped, for the cluster's own stop
                if process.poll() is None:
                    process.send_signal(signal.SIGCONT)


@contextlib.contextmanager
def _coordinator(cluster: LocalCluster, log: pathlib.Path):
    """A coordinator started again on the cluster's address (the one the servers know),
    with its token, and with a state db of its own: it knows nothing of the job before
    (tests/test_coordinator_restart.py restarts one on the same state db)."""
    address = cluster.address
    port = address.rsplit(":", 1)[1]
    process = subprocess.Popen([sys.executable, "-m", "interleaf.clients.cli", "coordinator", "--host", "127.0.0.1",
                                "--port", port, "--state-db", str(log.with_suffix(".db")), "--http-port", "0"],
                               stdout=subprocess.PIPE, stderr=log.open("ab"),
                               start_new_session=True, env={**os.environ, TOKEN_ENV: cluster.security.token})
    try:
        assert f"listening on {address}" in process.stdout.readline().decode()
        yield cluster.client()
    finally:
        process.terminate()
        process.wait(timeout=30)


def _start_long_job(client: Client) -> str:
    job_id = client.submit("", TINY + LAYOUT + ["train.steps=100000"]).job_id
    _wait_until(lambda: client.status(job_id).step >= 1, 120, "training under way")
    return job_id


def _runs_a_job(client: Client) -> None:
    _wait_until(lambda: sum(s.state == "IDLE" for s in client.servers()) == 2, 30, "both servers registered")
    final, steps = client.wait(client.submit("", TINY + LAYOUT).job_id, timeout_s=120)
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in steps] == [0, 1, 2]


def _log(cluster: LocalCluster, server: int) -> str:
    return (pathlib.Path(cluster.log_dir) / f"stage-server-{server}.log").read_text()


def _logged(cluster: LocalCluster, text: str) -> bool:
    return all(text in _log(cluster, i) for i in range(2))


def test_orphaned_server_drops_its_job_within_the_timeout(tmp_path):
    with _cluster(tmp_path, ORPHAN_TIMEOUT_S) as cluster:
        client = cluster.client()
        job_id = _start_long_job(client)
        cluster.processes[0].kill()  # the coordinator, mid-job
        killed = time.monotonic()
        # Dropped by the first heartbeat (one a second) that finds the coordinator silent
        # past the timeout since the last one it answered: within the timeout +-1 s of its death.
        _wait_until(lambda: _logged(cluster, f"dropping job {job_id}: the coordinator has been unreachable"),
                    ORPHAN_TIMEOUT_S + 1 + SLACK_S, "both servers dropped the job")
        assert time.monotonic() - killed > ORPHAN_TIMEOUT_S - 1
        # Free again: a new coordinator gets both back and runs a job on them.
        with _coordinator(cluster, tmp_path / "coordinator-2.log") as client:
            _runs_a_job(client)


def test_servers_of_a_restarted_coordinator_drop_the_stale_job(tmp_path):
    # Before the orphan timeout (30 s): the new coordinator's NOT_FOUND is what frees them.
    with _cluster(tmp_path) as cluster:
        client = cluster.client()
        _start_long_job(client)
        cluster.processes[0].kill()
        with _coordinator(cluster, tmp_path / "coordinator-2.log") as client:
            _runs_a_job(client)
        assert _logged(cluster, "the coordinator no longer knows this server (it restarted)")
        # Idle, with nothing left running, a server stopped exits cleanly, at once.
        server = cluster.processes[1]
        server.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        assert server.wait(timeout=EXIT_BOUND_S + SLACK_S) == 0
        assert time.monotonic() - signalled < EXIT_GRACE_S + SLACK_S
        assert "exiting now" not in _log(cluster, 0)


def test_busy_server_exits_on_sigterm_within_the_bound(tmp_path):
    # One RunSteps call for the whole job: the servers are never between calls.
    with _cluster(tmp_path, steps_per_call=100000) as cluster:
        _start_long_job(cluster.client())
        first, second = cluster.processes[1:]
        # The second server hangs: the first then waits on it inside a step. A send the
        # job's close lets go (the step ends, exit status 0); a receive or a collective
        # nothing reaches, and the server leaves that step when the calls' grace ends.
        second.send_signal(signal.SIGSTOP)
        time.sleep(0.5)
        first.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        code = first.wait(timeout=EXIT_BOUND_S + SLACK_S)
        gone = time.monotonic() - signalled
        left = f"a step still running {EXIT_GRACE_S:g} s after SIGTERM: exiting now" in _log(cluster, 0)
        assert (code, left) in ((0, False), (128 + signal.SIGTERM, True)), (code, left)
        assert gone < (EXIT_GRACE_S + SLACK_S if left else EXIT_BOUND_S)
        assert "still busy" not in _log(cluster, 0)
        # The hung one, resumed and stopped, finds its peer gone, or waits on it (gloo
        # does not always end a wait posted before the peer died) and leaves it so too.
        second.send_signal(signal.SIGCONT)
        second.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        second.wait(timeout=EXIT_BOUND_S + SLACK_S)
        assert time.monotonic() - signalled < EXIT_BOUND_S
        assert "still busy" not in _log(cluster, 1)


def test_dropped_job_frees_its_memory_at_once():
    """drop_job, as the registrar calls it, on two in-process services over real gloo:
    the job's model (weights, optimizer state, groups) is gone when it returns, without
    waiting for the cyclic garbage collector (disabled here so it cannot help)."""
    services = [StageServerService("127.0.0.1") for _ in range(2)]
    servers, stubs = serve_in_process(services)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    gc.disable()
    try:
        _, replies = _setup(stubs, store, "drop-1", comm_timeout_s=20)
        relayed = {g.name: g.id for g in replies[0].group_ids}
        assert _connect(stubs, "drop-1", [relayed, relayed]) == ["connected", "connected"]
        request = pb.RunStepsRequest(job_id="drop-1", first_step=0, num_steps=1)
        with ThreadPoolExecutor(2) as pool:
            assert [len(r) for r in pool.map(lambda stub: list(stub.RunSteps(request, timeout=60)), stubs)] == [1, 1]
        models = [weakref.ref(service._job.model) for service in services]
        for service in services:
            service.drop_job("the test drops it")
        assert [model() for model in models] == [None, None]
        _setup(stubs, store, "drop-2", comm_timeout_s=20)  # free for the next job
        _teardown(stubs, "drop-2")
    finally:
        gc.enable()
        for server in servers:
            server.stop(grace=None)


def test_a_burst_of_signals_stops_every_process_within_the_bound(tmp_path):
    """Signals in quick succession (a supervisor's TERM repeated, a user's Ctrl-C held):
    a later one can land while the first one's handler holds a lock it then takes again
    (a stage server once waited for ever on its own stop Event's lock); every process of
    the cluster, coordinator and servers, still exits within the bound."""
    with _cluster(tmp_path) as cluster:
        processes = list(cluster.processes)
        for i in range(30):
            for process in processes:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(signal.SIGTERM if i % 2 else signal.SIGINT)
        signalled = time.monotonic()
        for process in processes:
            process.wait(timeout=EXIT_BOUND_S + SLACK_S)
        assert time.monotonic() - signalled < EXIT_BOUND_S + SLACK_S


def test_plan_stopped_by_sigterm_while_profiling_leaves_nothing(tmp_path, monkeypatch):
    """`interleaf plan` measuring a profile on local servers: SIGTERM unwinds through
    them as `run`'s does - no process left, and no log or state folder of theirs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # nothing cached: it profiles
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))  # where the local cluster's folders go
    (tmp_path / "tmp").mkdir()
    marker = uuid.uuid4().hex
    process = _start(["plan", "--servers", "2", *SMALL], marker)
    try:
        _wait_until(lambda: len(_marked_processes(marker)) >= 4 or process.poll() is not None, 120,
                    "plan's profile servers started")  # interleaf plan, a coordinator, two servers
        assert process.poll() is None, process.communicate()[1]
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=RUN_GONE_S + SLACK_S)
        assert process.returncode == 128 + signal.SIGTERM, err
        assert "SIGTERM: stopping what the plan started" in err
        _wait_until(lambda: not _marked_processes(marker), RUN_GONE_S + SLACK_S, "every process of the plan gone")
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_ctrl_c_during_the_link_probe_prints_one_traceback_and_leaves_no_worker():
    """A terminal's Ctrl-C reaches the whole foreground group, the link probe's two
    spawned workers too (`interleaf plan` measuring a profile): each printed its own
    KeyboardInterrupt traceback beside the command's. They now ignore SIGINT and the
    probe stops them; only the caller sees the interrupt."""
    code = "from interleaf.clients.link_probe import measure_links\nmeasure_links()\n"
    probe = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while len(_children(probe.pid)) < 2 and probe.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        workers = _children(probe.pid)
        assert len(workers) >= 2, "the probe's workers never started"
        time.sleep(1.0)  # into their torch imports and groups, where a traceback came from
        os.killpg(probe.pid, signal.SIGINT)
        _, err = probe.communicate(timeout=30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(probe.pid, signal.SIGKILL)
    assert probe.returncode != 0 and err.count("Traceback") == 1 and err.rstrip().endswith("KeyboardInterrupt"), err
    deadline = time.monotonic() + 5
    while any(pathlib.Path(f"/proc/{pid}").exists() for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in workers if pathlib.Path(f"/proc/{pid}").exists()
                and "Z" not in pathlib.Path(f"/proc/{pid}/stat").read_text().split()[2]]


def _children(pid: int) -> list[int]:
    """The processes whose parent is `pid`, from /proc."""
    found = []
    for stat in pathlib.Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found
