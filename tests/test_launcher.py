"""`interleaf run --local`: trains, reports, and leaves no process behind on success,
on failure and on Ctrl-C."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
import uuid

from tests.conftest import TINY

SMALL = [arg for o in TINY + ["parallel.pp=2", "parallel.vpp=1"] for arg in ("--set", o)]


def _marked_processes(marker: str) -> list[int]:
    """Live processes whose environment carries `marker` (children inherit it)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        if marker.encode() in environ and state != "Z":
            found.append(int(entry.name))
    return found


def _start(args, marker, **kw):
    env = dict(os.environ, INTERLEAF_TEST_MARKER=marker)
    return subprocess.Popen([sys.executable, "-m", "interleaf.clients.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def _assert_no_orphans(marker):
    deadline = time.monotonic() + 15
    while _marked_processes(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _marked_processes(marker) == []


def test_run_trains_writes_metrics_and_cleans_up(tmp_path):
    marker = uuid.uuid4().hex
    metrics = tmp_path / "m.jsonl"
    process = _start(["run", *SMALL, "--metrics-out", str(metrics)], marker)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 0, err
    assert "step 3/3" in err and "loss" in err and "tok/s" in err
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2]
    for r in records:
        assert {"step", "loss", "tokens", "step_seconds", "grad_norm", "ranks"} <= set(r)
        assert r["tokens"] == 8 * 16 and r["step_seconds"] > 0 and 0 < r["loss"] < 10
        assert [m["rank"] for m in r["ranks"]] == [0, 1]
        for m in r["ranks"]:
            assert {"parameters_bytes", "gradients_bytes", "optimizer_bytes", "activations_peak_bytes",
                    "peak_bytes"} <= set(m)
            assert m["parameters_bytes"] > 0 and m["activations_peak_bytes"] > 0
            assert m["peak_bytes"] >= m["parameters_bytes"] + m["gradients_bytes"] + m["optimizer_bytes"]
    # Steps 0-2 are one RunSteps block: its last step carries the block's control time.
    assert "block_control_seconds" not in records[0] and records[-1]["block_steps"] == 3
    assert records[-1]["block_control_seconds"] > 0
    _assert_no_orphans(marker)


def test_failed_job_exits_nonzero_and_cleans_up(tmp_path):
    marker = uuid.uuid4().hex
    process = _start(["run", *SMALL, "--set", f"data.source={tmp_path / 'none.tokens'}"], marker)
    _, err = process.communicate(timeout=240)
    assert process.returncode == 1
    assert "FAILED" in err and "no token file" in err
    _assert_no_orphans(marker)


def test_ctrl_c_stops_everything():
    marker = uuid.uuid4().hex
    process = _start(["run", *SMALL, "--set", "train.steps=100000"], marker)
    # Wait for training to be under way: the progress line shows the first step.
    deadline = time.monotonic() + 180
    seen = ""
    while "step" not in seen and time.monotonic() < deadline:
        seen += process.stderr.readline()
    assert "step" in seen
    process.send_signal(signal.SIGINT)
    process.communicate(timeout=60)
    assert process.returncode == 130
    _assert_no_orphans(marker)
