"""trace.torch_profiler and trace.memory_snapshot (stageserver/profiling.py): each rank's
torch profiler Chrome trace of a traced step, collected by `interleaf trace` beside the
action timeline on a real local cluster; the CUDA memory snapshot refused on CPU servers
at every gate (config, --local, the coordinator's plan, the server's Setup). The snapshot's
GPU path needs a CUDA server and is not exercised here."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.step_profiles import profile_paths
from interleaf.protos.security import TOKEN_ENV
from interleaf.stageserver.profiling import ProfilingRejected, StepProfiler
from tests.conftest import TINY, run_job

PIPELINE = TINY + ["parallel.pp=2", "parallel.vpp=2", "parallel.dp=2"]


@pytest.fixture(scope="module")
def profiled_job(client):
    final, steps = run_job(client, PIPELINE + ["trace.torch_profiler=true", "trace.steps=[1]"])
    assert final.state == "SUCCEEDED", final.error
    return final, steps


def test_interleaf_trace_writes_a_chrome_trace_per_rank(cluster, client, profiled_job, tmp_path):
    final, _ = profiled_job
    out = tmp_path / "step1.json"
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "trace", final.job_id, "--out", str(out),
                             "--coordinator", cluster.address], capture_output=True, text=True, timeout=120,
                            env={**os.environ, TOKEN_ENV: cluster.security.token})
    assert result.returncode == 0, result.stderr[-3000:]
    assert out.is_file()  # the action timeline, as without the profiler
    for rank in range(4):
        path, snapshot = profile_paths(str(out), rank)
        assert path.name == f"step1.rank{rank}.torch.json" and f"{path} written" in result.stdout
        events = json.loads(path.read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        # The rank's real work: matrix multiplies of its forwards and backwards.
        assert any(n.startswith("aten::") and "mm" in n for n in names), sorted(names)[:20]
        assert not snapshot.exists()  # no memory_snapshot asked for


def test_only_traced_steps_are_profiled(client, profiled_job):
    final, _ = profiled_job
    trace = client.trace(final.job_id, 1)
    assert list(trace.traced_steps) == [1] and all(r.torch_profile for r in trace.reports)
    assert all(not r.memory_snapshot for r in trace.reports)


def test_profiler_settings_are_checked():
    config = load_config("", ["trace.torch_profiler=true", "trace.memory_snapshot=true"])
    assert config.trace.torch_profiler and config.trace.memory_snapshot
    with pytest.raises(ConfigError, match=r"trace.torch_profiler=true profiles the traced steps, and "
                                          r"trace.steps=\[\] traces none"):
        load_config("", ["trace.torch_profiler=true", "trace.steps=[]"])
    with pytest.raises(ConfigError, match=r"trace.memory_snapshot='yes' must be true or false"):
        load_config("", ["trace.memory_snapshot=yes"])


def test_memory_snapshot_on_cpu_servers_fails_the_job_before_setup(client):
    final, steps = run_job(client, PIPELINE + ["trace.memory_snapshot=true"], timeout_s=60)
    assert final.state == "FAILED" and not steps
    assert "trace.memory_snapshot=true records CUDA memory history, and the job's servers compute on cpu" in final.error


def test_memory_snapshot_is_refused_by_a_cpu_server_itself():
    """The stage server's own check, for a coordinator that did not make it."""
    with pytest.raises(ProfilingRejected, match="memory_snapshot records CUDA memory history, and this server "
                                                "computes on cpu"):
        StepProfiler(False, True, torch.device("cpu"))


def test_memory_snapshot_is_refused_by_interleaf_run_locally(tmp_path):
    overrides = [a for o in TINY + ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                                    "trace.memory_snapshot=true"] for a in ("--set", o)]
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "run", "--local", "1", "--device", "cpu",
                             *overrides], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "trace.memory_snapshot=true records CUDA memory history" in result.stderr
    assert "starting a coordinator" not in result.stderr
