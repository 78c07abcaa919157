"""The commands of a long-running deployment, against the shared cluster's coordinator:
submit, watch, status, cancel, servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from interleaf.common.security import TOKEN_ENV
from tests.conftest import SERVERS, TINY

LAYOUT = ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]


def _cli(cluster, *args, timeout=180):
    # The cluster's token, as a deployment passes it: in the environment.
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args, "--coordinator", cluster.address],
                            capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, TOKEN_ENV: cluster.security.token})
    return result


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def test_submit_watch_status(cluster, tmp_path):
    submitted = _cli(cluster, "submit", *_sets(TINY + LAYOUT))
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip()
    assert job_id.startswith("job-")

    metrics = tmp_path / "m.jsonl"
    watched = _cli(cluster, "watch", job_id, "--metrics-out", str(metrics))
    assert watched.returncode == 0, watched.stderr
    assert "step 3/3" in watched.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [0, 1, 2]

    status = json.loads(_cli(cluster, "status", job_id).stdout)
    assert status["state"] == "SUCCEEDED" and status["step"] == 3
    assert [r["rank"] for r in status["ranks"]] == [0, 1]


def test_cancel_and_servers(cluster):
    job_id = _cli(cluster, "submit", *_sets(TINY + LAYOUT + ["train.steps=100000"])).stdout.strip()
    listing = ""
    deadline = time.monotonic() + 120
    while listing.count("BUSY") < 2 and time.monotonic() < deadline:
        listing = _cli(cluster, "servers").stdout
        time.sleep(0.5)
    assert listing.count(job_id) == 2 and len(listing.splitlines()) == SERVERS
    cancelled = _cli(cluster, "cancel", job_id)
    assert cancelled.returncode == 0 and cancelled.stdout.strip() in ("RUNNING", "SETTING_UP", "CANCELLED")
    watched = _cli(cluster, "watch", job_id)
    assert watched.returncode == 1 and f"job {job_id} CANCELLED" in watched.stderr
    assert _cli(cluster, "servers").stdout.count("IDLE") == SERVERS


def test_run_against_a_running_coordinator(cluster, tmp_path):
    metrics = tmp_path / "m.jsonl"
    result = _cli(cluster, "run", *_sets(TINY + LAYOUT), "--metrics-out", str(metrics))
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("submitted job-")
    assert "starting a coordinator" not in result.stderr
    assert len(metrics.read_text().splitlines()) == 3
