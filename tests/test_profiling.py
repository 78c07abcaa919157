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

import grpc
import pytest
import torch

from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.step_profiles import profile_paths
from interleaf.coordinator.traces import Traces
from interleaf.protos import interleaf_pb2 as pb
from interleaf.common.security import TOKEN_ENV
from interleaf.stageserver.profiling import ProfilingRejected, StepProfiler, within_bound
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


def test_only_traced_steps_are_profiled_and_profiles_come_one_rank_at_a_time(client, profiled_job):
    final, _ = profiled_job
    trace = client.trace(final.job_id, 1)
    assert list(trace.traced_steps) == [1] and list(trace.profiled_ranks) == [0, 1, 2, 3]
    assert not trace.profile_notes
    # The trace itself carries no profile: each rank's is its own reply.
    assert all(not r.torch_profile and not r.memory_snapshot for r in trace.reports)
    for rank in range(4):
        report = client.trace_profile(final.job_id, 1, rank)
        assert report.rank == rank and report.step == 1
        assert report.torch_profile and not report.memory_snapshot
        assert report.spans == trace.reports[rank].spans  # the same report, whole


def test_a_rank_without_a_profile_is_not_found(cluster, client, profiled_job):
    final, _ = profiled_job
    with pytest.raises(grpc.RpcError) as caught:
        client.trace_profile(final.job_id, 1, 7)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "keeps no profile of rank 7 (profiled ranks: [0, 1, 2, 3])" in caught.value.details()


def _report(rank: int, profile: bytes = b"", snapshot: bytes = b"") -> pb.StepReport:
    return pb.StepReport(rank=rank, step=2, step_seconds=0.5, torch_profile=profile, memory_snapshot=snapshot)


def test_a_profile_over_the_bound_is_dropped_with_a_note_and_the_trace_kept():
    """coordinator/traces.py: a profile too large for one reply (a server that did not
    hold to wire.MAX_PROFILE_BYTES) is dropped and named; the others and the spans stay;
    a profile asked for and missing (the server dropped it) is named too."""
    stored = []
    traces = Traces(persist=stored.append, profiled=(True, False), max_profile_bytes=100)
    traces.add(pb.StepTrace(job_id="j"), [_report(1, b"x" * 100), _report(0, b"y" * 101), _report(2)])
    trace = traces.get(2)
    assert [r.rank for r in trace.reports] == [0, 1, 2] and list(trace.profiled_ranks) == [1]
    assert list(trace.profile_notes) == [
        "rank 0: its torch profile of 101 bytes (gzip) is over the 100 a trace keeps: dropped",
        "rank 2: no torch profile: its server drops one over 100 bytes gzip-compressed (its log names the size)"]
    assert all(not r.torch_profile for r in trace.reports)
    assert traces.profile(2, 1).reports[0].torch_profile == b"x" * 100
    assert traces.profile(None, 0) is None and traces.profile(2, 2) is None
    # Written through whole (profiles included, the dropped one not), and served alike after a restart.
    assert [r.torch_profile for r in stored[0].reports] == [b"", b"x" * 100, b""]
    again = Traces(stored, profiled=(True, False), max_profile_bytes=100)
    assert again.get(2) == trace and again.profile(2, 1) == traces.profile(2, 1)


def test_a_step_run_again_replaces_its_profiles():
    traces = Traces(profiled=(True, False))
    traces.add(pb.StepTrace(job_id="j"), [_report(0, b"first"), _report(1, b"first")])
    traces.add(pb.StepTrace(job_id="j"), [_report(0, b"again"), _report(1)])
    assert list(traces.get(2).profiled_ranks) == [0]
    assert traces.profile(2, 0).reports[0].torch_profile == b"again" and traces.profile(2, 1) is None


def test_a_server_drops_a_profile_over_the_bound():
    assert within_bound(b"x" * 10, "torch profile", most=10) == b"x" * 10
    assert within_bound(b"x" * 11, "torch profile", most=10) == b""


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
