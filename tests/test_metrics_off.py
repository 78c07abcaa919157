"""Stage servers started with --metrics-port -1 (LocalCluster(metrics=False)): no HTTP
server, left out of the coordinator's /sd, no communication metering, and the same
training as metered servers. Also that `trace.steps = []` traces nothing: together the
two are the unobserved side of bench/observability_cost.py."""

from __future__ import annotations

import json
import os
import urllib.request

import grpc
import pytest

from interleaf.clients.launcher import LocalCluster

JOB = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.vocab_size=256",
       "train.global_batch=8", "train.warmup_steps=1", "train.steps=3", "parallel.microbatches=2",
       "parallel.dp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b", "trace.steps=[1]"]


def _listening_ports(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on: its sockets' inodes (/proc/PID/fd) found
    among the LISTEN entries of its network namespace's socket tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    ports = set()
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # st 0A: LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def _run(metrics: bool, log_dir: str) -> dict:
    with LocalCluster(2, threads_per_server=1, log_dir=log_dir, metrics=metrics) as cluster:
        client = cluster.client()
        try:
            servers = client.servers()
            grpc_ports = {int(s.address.rsplit(":", 1)[1]) for s in servers}
            listening = [_listening_ports(p.pid) for p in cluster.processes[1:]]  # [0] is the coordinator
            with urllib.request.urlopen(f"http://{cluster.http_address}/sd", timeout=10) as reply:
                discovered = json.loads(reply.read())
            traced = client.submit("", JOB)
            status, steps = client.wait(traced.job_id, timeout_s=300)
            assert status.state == "SUCCEEDED", status.error
            reports = client.trace(traced.job_id, 1).reports
            if not metrics:  # trace.steps=[] does not depend on metrics: checked once
                untraced = client.submit("", [*JOB, "trace.steps=[]"])
                status, _ = client.wait(untraced.job_id, timeout_s=300)
                assert status.state == "SUCCEEDED", status.error
                with pytest.raises(grpc.RpcError) as no_trace:
                    client.trace(untraced.job_id)
                assert no_trace.value.code() == grpc.StatusCode.NOT_FOUND
        finally:
            client.close()
    return {"servers": servers, "grpc_ports": grpc_ports, "listening": listening, "sd": discovered,
            "losses": [s.loss for s in sorted(steps, key=lambda s: s.step)], "reports": reports}


def test_servers_without_metrics_serve_none_are_not_discovered_and_train_the_same_job(tmp_path):
    off = _run(False, str(tmp_path / "off"))
    on = _run(True, str(tmp_path / "on"))

    assert [s.metrics_port for s in off["servers"]] == [0, 0]
    assert off["sd"] == []
    # Each server listens on its gRPC port and nothing else: no /metrics anywhere.
    assert sorted(map(sorted, off["listening"])) == sorted([p] for p in off["grpc_ports"])
    assert len(off["reports"]) == 2 and all(not r.comm for r in off["reports"])

    # The metered cluster, the same way: what the checks above would have seen.
    metrics_ports = {s.metrics_port for s in on["servers"]}
    assert 0 not in metrics_ports and len(metrics_ports) == 2
    assert sorted(t for g in on["sd"] for t in g["targets"]) == sorted(f"127.0.0.1:{p}" for p in metrics_ports)
    assert set().union(*on["listening"]) == on["grpc_ports"] | metrics_ports
    assert all({c.op for c in r.comm} >= {"all_reduce"} for r in on["reports"])

    assert len(off["losses"]) == 3
    assert off["losses"] == on["losses"]  # bit for bit: metering only reads clocks and sizes
