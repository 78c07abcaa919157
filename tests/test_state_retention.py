"""The coordinator's state database stays bounded (--keep-jobs): a real coordinator
keeping 5 finished jobs runs JOBS tiny real jobs one after another, and the database's
files (the SQLite file and its -wal) stop growing once the first few are pruned; a
pruned job's status answers NOT_FOUND by name while the newest 5 stay readable, and
/metrics counts the pruned jobs. A --keep-jobs below 1 is refused by name."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import time
import urllib.request

import grpc
from prometheus_client.parser import text_string_to_metric_families

from interleaf.clients.launcher import LocalCluster
from tests.conftest import TINY

KEEP = 5
JOBS = 40
PLATEAU_AFTER = 15
"""By then KEEP jobs are kept and many pruned: the pages freed by each prune are what
the next job's rows reuse, or incremental_vacuum has given them back."""
SLACK_BYTES = 16 * 4096
"""Some pages of wobble: a job's rows differ by a few hundred bytes (its id, timings),
which can tip a B-tree page split one way or the other."""
ONE_SERVER = ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b", "train.steps=2"]


def _bytes(path: str) -> int:
    """The database's size on disk: the file and its write-ahead log."""
    return sum(os.path.getsize(p) for p in (path, f"{path}-wal") if os.path.exists(p))


def _run(client, overrides: list[str]) -> str:
    job_id = client.submit("", overrides).job_id
    deadline = time.monotonic() + 120
    while (state := client.status(job_id).state) not in ("SUCCEEDED", "FAILED", "CANCELLED"):
        assert time.monotonic() < deadline, f"{job_id} still {state}"
        time.sleep(0.05)
    assert state == "SUCCEEDED", client.status(job_id).error
    return job_id


def _pruned(client, job_id: str) -> grpc.RpcError:
    """Waits for the job to be pruned: the coordinator prunes just after the newer job's
    final state is published (a status call can see that state first); the database is
    vacuumed and its -wal truncated before the job stops being found."""
    deadline = time.monotonic() + 30
    while True:
        try:
            client.status(job_id)
        except grpc.RpcError as err:
            return err
        assert time.monotonic() < deadline, f"{job_id} was not pruned"
        time.sleep(0.02)


def test_many_tiny_jobs_keep_the_state_database_bounded(tmp_path):
    state_db = str(tmp_path / "coordinator.db")
    started = time.monotonic()
    with LocalCluster(1, threads_per_server=1, state_db=state_db, keep_jobs=KEEP,
                      log_dir=str(tmp_path / "logs")) as cluster:
        client = cluster.client()
        try:
            ids, sizes = [], []
            for i in range(JOBS):
                ids.append(_run(client, TINY + ONE_SERVER))
                if i >= KEEP:  # this job's finish pruned the one KEEP before it
                    pruned = _pruned(client, ids[i - KEEP])
                sizes.append(_bytes(state_db))
            kept = [client.status(job_id).state for job_id in ids[-KEEP:]]
            with urllib.request.urlopen(f"http://{cluster.http_address}/metrics", timeout=10) as reply:
                metrics = {(s.name, s.labels.get("state")): s.value
                           for f in text_string_to_metric_families(reply.read().decode()) for s in f.samples}
        finally:
            client.close()
    print(f"\n{JOBS} jobs in {time.monotonic() - started:.1f}s; database bytes after each job: {sizes}")

    assert pruned.code() == grpc.StatusCode.NOT_FOUND
    assert pruned.details() == (f"no job '{ids[-KEEP - 1]}': never submitted to this coordinator, or finished and "
                                f"removed (it keeps the newest {KEEP} finished jobs, --keep-jobs)")
    assert kept == ["SUCCEEDED"] * KEEP
    assert metrics[("interleaf_jobs_pruned_total", None)] == JOBS - KEEP
    assert metrics[("interleaf_jobs", "SUCCEEDED")] == KEEP
    # The plateau: every size after PLATEAU_AFTER jobs within some pages of the size then.
    assert max(sizes[PLATEAU_AFTER:]) <= sizes[PLATEAU_AFTER - 1] + SLACK_BYTES, sizes
    db = sqlite3.connect(state_db)  # the coordinator has stopped: its lock is free
    try:
        assert [j for (j,) in db.execute("SELECT job_id FROM jobs ORDER BY number")] == ids[-KEEP:]
        assert db.execute("SELECT COUNT(*) FROM events WHERE job_id NOT IN (SELECT job_id FROM jobs)").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM traces WHERE job_id NOT IN (SELECT job_id FROM jobs)").fetchone() == (0,)
        assert db.execute("SELECT COUNT(*) FROM traces").fetchone()[0] >= KEEP  # the kept jobs' traces stay
    finally:
        db.close()


def test_keep_jobs_below_one_is_refused_before_the_coordinator_starts(tmp_path):
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "coordinator", "--keep-jobs", "-3",
                             "--state-db", str(tmp_path / "coordinator.db"), "--port", "0", "--http-port", "0"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and not (tmp_path / "coordinator.db").exists()
    assert result.stderr.strip() == ("error: --keep-jobs=-3 must be at least 1: the newest job to finish stays in "
                                     "the state database so that its client can still read how it ended")
