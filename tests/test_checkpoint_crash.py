"""Crash safety of checkpoints: the coordinator or a stage server killed with SIGKILL
while a job saves a checkpoint after every step leaves the newest complete checkpoint
loadable, and resuming it reproduces the run that was never stopped (issue 8).

Each save writes every rank's state file and then the manifest (fsync, rename); with a
save after every step of a small model most of the job's time is saving, so a kill at
these delays lands in or between saves (seen when this was written: one kill left a
step folder with every rank's files but no manifest, another with some of them only). Whatever it hit, a step folder without a manifest is never read, and the newest
one with a manifest verifies file by file."""

from __future__ import annotations

import signal
import time

import pytest

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.checkpoints import MANIFEST, find
from tests.conftest import TINY, layout_free, reference, run_job
from tests.test_equivalence import LOSS_RTOL

SETTINGS = TINY + ["train.steps=40"]


@pytest.mark.parametrize("victim,delay_s", [("coordinator", 0.4), ("coordinator", 1.1), ("stage server", 0.7)])
def test_a_process_killed_mid_save_leaves_the_last_complete_checkpoint_resumable(client, tmp_path, victim, delay_s):
    root = tmp_path / "ckpt"
    with LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path / "logs")) as doomed:
        doomed_client = doomed.client()
        job = doomed_client.submit("", SETTINGS + [f"checkpoint.dir={root}", "checkpoint.every=1"])
        deadline = time.monotonic() + 120
        while not any((p / MANIFEST).exists() for p in root.glob("step-*")):
            assert time.monotonic() < deadline, "no checkpoint was completed"
            time.sleep(0.02)
        time.sleep(delay_s)
        process = doomed.processes[0 if victim == "coordinator" else 1]  # the coordinator is started first
        process.send_signal(signal.SIGKILL)
        process.wait()
        doomed_client.close()
        assert job.job_id
    newest = find(root)
    newest.paths()  # every file present and matching its SHA-256
    assert 1 <= newest.step < 40
    history, _ = reference(layout_free(SETTINGS))
    final, steps = run_job(client, SETTINGS + [f"checkpoint.resume={root}"])
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in steps] == list(range(newest.step, 40))
    for got in steps:
        want = history[got.step]
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
