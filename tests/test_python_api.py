"""The Python API (interleaf.Client, Job, typed configs and events), and docs/running.md's
example run as written."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import grpc
import pytest

import interleaf
from interleaf.clients.api import Checkpoint, JobStatus, Step, config_text
from interleaf.coordinator.config import load_config

ROOT = pathlib.Path(__file__).resolve().parent.parent
TINY = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "parallel.pp=1",
        "parallel.vpp=1", "parallel.schedule=1f1b", "train.global_batch=4", "parallel.microbatches=2",
        "train.warmup_steps=1"]


def readme_example() -> str:
    text = (ROOT / "docs" / "running.md").read_text()
    found = re.search(r"<!-- python-example:[^>]*-->\n```python\n(.*?)```", text, re.S)
    assert found, "docs/running.md's Python example (marked python-example) is missing"
    return found.group(1)


def test_readme_example_runs():
    result = subprocess.run([sys.executable, "-c", readme_example()], capture_output=True, text=True,
                            timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split(":")[0] for line in steps] == [f"step {n}" for n in range(1, 11)]
    losses = [float(re.search(r"loss (\S+),", line).group(1)) for line in steps]
    assert losses[-1] < losses[0]
    job_id, state, step = lines[len(steps)].split()
    assert (state, step) == ("SUCCEEDED", "10") and job_id.startswith("job-")
    again_id, again_state, again_loss = lines[len(steps) + 1].split()
    assert again_state == "SUCCEEDED" and again_id != job_id and float(again_loss) > 0


def test_typed_config_round_trips_as_toml():
    config = interleaf.JobConfig(train=interleaf.TrainConfig(steps=7, lr=1e-3),
                                 parallel=interleaf.ParallelConfig(dp=2, pp=1, vpp=1, schedule="gpipe"))
    assert load_config(config_text(config)) == config


def test_config_from_path_and_text(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("[train]\nsteps = 3\n")
    assert config_text(str(path)) == config_text(path) == "[train]\nsteps = 3\n"
    assert config_text("[train]\nsteps = 3\n") == "[train]\nsteps = 3\n"
    with pytest.raises(FileNotFoundError):
        config_text(str(tmp_path / "missing.toml"))
    with pytest.raises(TypeError, match="must be a TOML path"):
        config_text(3)


def test_bad_typed_config_is_refused_where_it_is_built():
    with pytest.raises(interleaf.ConfigError, match="parallel.microbatches=3 must be a multiple of parallel.pp=2"):
        interleaf.ParallelConfig(pp=2, vpp=2, microbatches=3)


def test_job_handle_reports_typed_values(cluster, tmp_path):
    client = interleaf.Client(cluster.address, cluster.security)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.submit("", ["parallel.dp=0"])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT

        job = client.submit("", TINY + ["train.steps=4", f"checkpoint.dir={tmp_path}", "checkpoint.every=2"])
        events = list(job.events(timeout_s=120))
        steps = [e for e in events if isinstance(e, Step)]
        assert [s.step for s in steps] == [1, 2, 3, 4]
        assert all(s.loss > 0 and s.tokens_per_second > 0 and s.grad_norm > 0 for s in steps)
        assert [c.step for c in events if isinstance(c, Checkpoint) and c.kind == "saved"] == [2, 4]
        assert isinstance(events[-1], JobStatus) and events[-1].state == "SUCCEEDED"
        status = job.wait()
        assert status.final and status.step == 4 and status.last.loss == steps[-1].loss
        assert client.job(job.id).status() == status
        assert all(s.state == "IDLE" for s in client.servers())

        failing = client.submit("", TINY + ["train.steps=50", "train.lr=1e30", "train.warmup_steps=0"])
        with pytest.raises(interleaf.JobFailed, match=f"job {failing.id} failed at step"):
            failing.wait(timeout_s=120)

        running = client.submit("", TINY + ["train.steps=100000"])
        next(running.steps(timeout_s=120))
        assert running.cancel().job_id == running.id
        assert running.wait(timeout_s=60).state == "CANCELLED"
    finally:
        client.close()
