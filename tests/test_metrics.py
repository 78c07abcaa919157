"""Prometheus metrics end to end: a real local cluster (a coordinator and 2 stage servers
as processes), a real Prometheus (Debian's `prometheus`) scraping it through the shipped
docker/prometheus.yml with the coordinator's service discovery, and the figures held
to what the jobs must have done; with no cluster, the counting's own cases (past a job's
kept history, concurrent scrapes, restarts, cancelled streams, failing pages, dead servers)."""

from __future__ import annotations

import json
import math
import pathlib
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from concurrent import futures

import grpc
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import load_config
from interleaf.coordinator.flops import flops_per_token
from interleaf.coordinator.http_server import service_discovery
from interleaf.coordinator.jobs import MAX_EVENTS, JobRecord
from interleaf.coordinator.memory_model import bucket_sizes
from interleaf.coordinator.metrics import CoordinatorMetrics
from interleaf.coordinator.partition import partition
from interleaf.coordinator.registry import DEAD_AFTER_S, Registry
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.http import HttpServer, metrics_route
from interleaf.common.rpc_metrics import RpcLatency
from interleaf.common.security import Security
from interleaf.stageserver.metrics import StageMetrics
from interleaf.stageserver.service import StageServerService

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROMETHEUS_YML = ROOT / "docker" / "prometheus.yml"
DASHBOARD = ROOT / "docker" / "grafana" / "dashboards" / "interleaf.json"
MODEL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=4", "model.seq_len=16", "model.vocab_size=256",
         "train.global_batch=8", "train.warmup_steps=1", "parallel.microbatches=4"]
# Long enough (measured: 7.6 s on 2 shared cores) for several of the test's 1 s scrapes.
PIPELINE = [*MODEL, "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b", "train.steps=150"]
DATA_PARALLEL = [*MODEL, "parallel.dp=2", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b",
                 "train.steps=12"]
# Every family a stage server exports once it has run a step (per-job series).
STAGE_FAMILIES = {
    "interleaf_rank_step_seconds_count", "interleaf_rank_compute_seconds_total", "interleaf_rank_blocked_seconds_total",
    "interleaf_rank_idle_seconds_total", "interleaf_pipeline_bubble_ratio", "interleaf_comm_seconds_total",
    "interleaf_comm_bytes_total", "interleaf_comm_operations_total", "interleaf_memory_bytes",
    "interleaf_memory_peak_bytes", "interleaf_process_resident_peak_bytes", "interleaf_device_allocated_peak_bytes",
    "interleaf_device_peak_flops", "interleaf_rpc_server_seconds_count",
}


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed: apt-get install prometheus (.ci/run does)")
    return path


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.read()


def _samples(address: str) -> list:
    """Every sample of a /metrics endpoint, parsed as Prometheus parses it."""
    text = _get(f"http://{address}/metrics").decode()
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def _value(samples: list, name: str, **labels) -> float:
    found = [s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples"
    return found[0]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path_factory.mktemp("metrics-logs"))) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster):
    c = cluster.client()
    yield c
    c.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    """Prometheus on loopback with the shipped config, pointed at this cluster's
    coordinator and scraping every second; yields its HTTP API's address."""
    folder = tmp_path_factory.mktemp("prometheus")
    config = PROMETHEUS_YML.read_text().replace("coordinator:50052", cluster.http_address)
    config = config.replace("scrape_interval: 5s", "scrape_interval: 1s").replace("refresh_interval: 10s",
                                                                                  "refresh_interval: 1s")
    (folder / "prometheus.yml").write_text(config)
    address = f"127.0.0.1:{_free_port()}"
    with open(folder / "prometheus.log", "wb") as log:
        process = subprocess.Popen([_tool("prometheus"), f"--config.file={folder / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address={address}"],
                                   stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                _get(f"http://{address}/-/ready")
                break
            except OSError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"prometheus did not start: {(folder / 'prometheus.log').read_text()[-2000:]}")
                time.sleep(0.2)
        yield address
    finally:
        process.terminate()
        process.wait(timeout=30)


def _query(prometheus: str, expr: str) -> list:
    reply = json.loads(_get(f"http://{prometheus}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
    assert reply["status"] == "success", reply
    return reply["data"]["result"]


def _run(client, overrides: list[str]):
    status = client.submit("", overrides)
    final, steps = client.wait(status.job_id, timeout_s=300)
    assert final.state == "SUCCEEDED", final.error
    return final, steps


def test_promtool_accepts_the_shipped_config():
    checked = subprocess.run([_tool("promtool"), "check", "config", str(PROMETHEUS_YML)], capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_dashboard_panels_each_query_prometheus():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "interleaf"
    titles = [panel["title"] for panel in dashboard["panels"]]
    assert len(titles) == len(set(titles))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"] and all(t["expr"].strip() for t in panel["targets"]), panel["title"]


def _stage_targets(prometheus: str) -> dict:
    targets = json.loads(_get(f"http://{prometheus}/api/v1/targets"))["data"]["activeTargets"]
    return {t["labels"].get("server_id"): t for t in targets if t["labels"]["job"] == "interleaf-stage-servers"}


def test_prometheus_finds_every_server_and_every_dashboard_query_has_data(cluster, client, prometheus, tmp_path):
    servers = {s.server_id: s for s in client.servers()}
    deadline = time.monotonic() + 30  # discovered through /sd and scraped once
    while set(_stage_targets(prometheus)) != set(servers) or not all(
            t["health"] == "up" for t in _stage_targets(prometheus).values()):
        assert time.monotonic() < deadline, _stage_targets(prometheus)
        time.sleep(0.5)
    started = time.monotonic()
    final, _ = _run(client, [*PIPELINE, f"checkpoint.dir={tmp_path / 'checkpoints'}"])
    print(f"the job ran {time.monotonic() - started:.1f} s")
    time.sleep(3)  # a few more scrapes after the job's last step

    found = _stage_targets(prometheus)
    assert set(found) == set(servers)
    for server_id, target in found.items():
        assert target["health"] == "up", target
        assert target["scrapeUrl"] == f"http://127.0.0.1:{servers[server_id].metrics_port}/metrics"

    arrived = {(r["metric"]["server_id"], r["metric"]["__name__"]) for r in _query(
        prometheus, 'group by (server_id, __name__) ({__name__=~"interleaf_.+", server_id!=""})')}
    for server_id in servers:
        missing = STAGE_FAMILIES - {name for sid, name in arrived if sid == server_id}
        assert not missing, f"server {server_id}: no {sorted(missing)}"
    stepped = _query(prometheus, f'interleaf_rank_step_seconds_count{{job="{final.job_id}"}}')
    ranks = {r["metric"]["rank"] for r in stepped}
    assert ranks == {"0", "1"}

    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"].replace("$interleaf_job", final.job_id).replace("$__rate_interval", "1m")
            result = _query(prometheus, expr)
            values = [float(r["value"][1]) for r in result]
            assert any(math.isfinite(v) for v in values), f"panel {panel['title']!r}: {expr} gave {result}"


def test_values_hold_to_what_the_job_did(cluster, client):
    started = time.monotonic()
    final, steps = _run(client, DATA_PARALLEL)
    elapsed = time.monotonic() - started
    config = load_config("", DATA_PARALLEL)
    job, n = final.job_id, config.train.steps
    coordinator = _samples(cluster.http_address)
    servers = {s.address: s for s in client.servers()}
    peaks = [servers[r.server_address].peak_flops for r in final.ranks]
    assert all(p > 0 for p in peaks)

    # Tokens: every step's global batch; tokens/s is the last step's: its tokens over the
    # coordinator's wall time from the previous step's completion (a RunSteps block's
    # first step: from the block's start) to its own. Those intervals lie within the job's
    # run, so their sum is at most the run's time as this test saw it; every rank's steps
    # ran within them, so each rank's summed step time is at most their sum (below). Both
    # hold however much control-plane time a loaded machine adds, unlike a ratio to the
    # step time (measured 0.58-1.83 for one step: reports arrive in bursts).
    tokens = config.train.global_batch * config.model.seq_len
    assert _value(coordinator, "interleaf_tokens_total", job=job) == n * tokens
    assert _value(coordinator, "interleaf_tokens_per_second", job=job) == pytest.approx(
        steps[-1].tokens_per_second, rel=1e-12)
    assert len(steps) == n
    wall = sum(tokens / s.tokens_per_second for s in steps)
    assert wall <= elapsed, (wall, elapsed)
    assert _value(coordinator, "interleaf_step_seconds_count", job=job) == n
    assert _value(coordinator, "interleaf_step_seconds_sum", job=job) == pytest.approx(
        sum(s.step_seconds for s in steps), rel=1e-9)
    assert _value(coordinator, "interleaf_loss", job=job) == pytest.approx(steps[-1].loss, rel=1e-12)

    # MFU: model FLOPs of the last step over its time and the servers' summed peak.
    m = config.model
    flops = flops_per_token(m) * tokens
    mfu = _value(coordinator, "interleaf_model_flops_utilization_ratio", job=job)
    assert mfu == pytest.approx(flops / (steps[-1].step_seconds * sum(peaks)), rel=1e-9)
    assert 0 < mfu < 1

    # Communication: dp=2 at ZeRO-0 all-reduces each bucket's padded fp32 gradient once
    # a step; the global norm is one float64 all-reduced over the world; no pipeline.
    (chunk,) = partition(m.n_layers, 1, 1)
    gradient_bytes = 4 * sum(-(-size // 2) * 2 for size in bucket_sizes(config, chunk))
    for rank in final.ranks:
        samples = _samples(f"127.0.0.1:{servers[rank.server_address].metrics_port}")
        mine = {"job": job, "rank": str(rank.rank)}
        assert _value(samples, "interleaf_comm_bytes_total", op="all_reduce", group="dp", **mine) \
            == n * gradient_bytes
        assert _value(samples, "interleaf_comm_operations_total", op="all_reduce", group="dp", **mine) \
            == n * len(bucket_sizes(config, chunk))
        assert _value(samples, "interleaf_comm_bytes_total", op="all_reduce", group="world", **mine) == n * 8
        assert not [s for s in samples if s.name == "interleaf_comm_bytes_total" and s.labels["group"] == "pp"]
        comm_seconds = sum(s.value for s in samples if s.name == "interleaf_comm_seconds_total")
        step_sum = _value(samples, "interleaf_rank_step_seconds_sum", **mine)
        assert 0 < comm_seconds < step_sum
        assert step_sum <= wall, (rank.rank, step_sum, wall)  # the tokens/s intervals hold its steps

        # Idle time is the step's time outside compute; the bubble ratio the last step's share.
        compute = _value(samples, "interleaf_rank_compute_seconds_total", **mine)
        idle = _value(samples, "interleaf_rank_idle_seconds_total", **mine)
        assert compute + idle == pytest.approx(step_sum, rel=1e-6)
        assert 0 <= _value(samples, "interleaf_pipeline_bubble_ratio", stage="0", **mine) <= 1

        # Memory: the gauges are the last step's report.
        memory = final.last.ranks[rank.rank]
        assert _value(samples, "interleaf_memory_peak_bytes", kind="all", **mine) == memory.peak_bytes
        for kind in ("parameters", "gradients", "optimizer"):
            assert _value(samples, "interleaf_memory_bytes", kind=kind, **mine) == getattr(memory, f"{kind}_bytes")
        assert _value(samples, "interleaf_device_peak_flops") == servers[rank.server_address].peak_flops


def test_rpc_latency_counts_every_call_by_method_and_code_refused_ones_too():
    """Two stage servers in this process, each with its own registry (the tests serve
    many in one process), one guarded by a token; calls counted per server."""
    token = "metrics-test-token"
    endpoints = []
    for _ in range(2):
        metrics = StageMetrics()
        server = wire.server(threads=2, security=Security(token=token), interceptors=(RpcLatency(metrics.registry),))
        rpc.add_StageServerServicer_to_server(StageServerService("127.0.0.1", metrics=metrics), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        http = HttpServer({"/metrics": metrics_route(metrics.registry)}, "127.0.0.1", 0).start()
        endpoints.append((server, http, f"127.0.0.1:{port}"))
    try:
        first, second = (rpc.StageServerStub(wire.channel(address, Security(token=t)))
                         for (_, _, address), t in zip(endpoints, (token, "wrong")))
        for _ in range(3):
            first.Teardown(pb.JobRef(job_id="none"), timeout=5)
        with pytest.raises(grpc.RpcError) as missing:
            first.FinishSaves(pb.JobRef(job_id="none"), timeout=5)
        assert missing.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as refused:
            second.Teardown(pb.JobRef(job_id="none"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED

        counted = [_samples(f"127.0.0.1:{http.port}") for _, http, _ in endpoints]
        count = "interleaf_rpc_server_seconds_count"
        assert _value(counted[0], count, method="Teardown", code="OK") == 3
        assert _value(counted[0], count, method="FinishSaves", code="NOT_FOUND") == 1
        assert _value(counted[1], count, method="Teardown", code="UNAUTHENTICATED") == 1
        assert not [s for s in counted[1] if s.name == count and s.labels["code"] == "OK"]
        with pytest.raises(urllib.error.HTTPError) as unknown:
            _get(f"http://127.0.0.1:{endpoints[0][1].port}/nothing")
        assert unknown.value.code == 404
    finally:
        for server, http, _ in endpoints:
            http.stop()
            server.stop(grace=None)


def _counted(metrics: CoordinatorMetrics, name: str, job: str) -> float:
    return metrics.registry.get_sample_value(name, {"job": job}) or 0.0


def test_counters_count_every_event_past_the_kept_history_and_concurrent_scrapes_count_each_once():
    """A job keeps its newest MAX_EVENTS events; the counters go on past them, counting
    each event once however many scrapes run at the same time."""
    record = JobRecord("job-1-00001", load_config("", DATA_PARALLEL))
    metrics = CoordinatorMetrics(Registry(), lambda: [record])
    scrapes = 4
    for step in range(3 * MAX_EVENTS):
        record.add_step(pb.StepEvent(step=step, tokens=1, step_seconds=0.01, tokens_per_second=100.0))
        if step % 500 == 499:  # between scrapes, fewer steps than the history keeps
            threads = [threading.Thread(target=metrics.update) for _ in range(scrapes)]
            with record._changed:  # each scrape would read what it has counted, then wait here
                for t in threads:
                    t.start()
                time.sleep(0.1)
            for t in threads:
                t.join()
    metrics.update()
    assert record.events_dropped == 2 * MAX_EVENTS
    assert _counted(metrics, "interleaf_tokens_total", record.job_id) == 3 * MAX_EVENTS
    assert _counted(metrics, "interleaf_step_seconds_count", record.job_id) == 3 * MAX_EVENTS


def test_a_coordinator_restart_is_counted_apart_from_recoveries():
    record = JobRecord("job-1-00001", load_config("", DATA_PARALLEL))
    metrics = CoordinatorMetrics(Registry(), lambda: [record])
    record.add_recovery(pb.RecoveryEvent(attempt=0, failure="the coordinator restarted", recover_seconds=9.0))
    record.add_recovery(pb.RecoveryEvent(attempt=1, failure="lost", lost=["a:1", "b:2"], recover_seconds=2.0))
    metrics.update()
    job = record.job_id
    assert _counted(metrics, "interleaf_coordinator_restarts_total", job) == 1
    assert _counted(metrics, "interleaf_recoveries_total", job) == 1
    assert _counted(metrics, "interleaf_lost_servers_total", job) == 2
    assert _counted(metrics, "interleaf_recovery_seconds", job) == 2.0


def test_a_stream_its_client_cancels_is_counted_cancelled():
    registry = CollectorRegistry()

    def forever(request, context):
        while True:
            yield b"x"
            time.sleep(0.01)

    handler = grpc.method_handlers_generic_handler("test.Streams", {
        "Forever": grpc.unary_stream_rpc_method_handler(forever)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), interceptors=(RpcLatency(registry),))
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/test.Streams/Forever")(b"")
            next(call)  # the stream is under way
            call.cancel()
        count = {"method": "Forever"}
        deadline = time.monotonic() + 10  # the server sees the cancellation at its next message
        while registry.get_sample_value("interleaf_rpc_server_seconds_count", {**count, "code": "CANCELLED"}) is None:
            assert time.monotonic() < deadline, list(registry.collect())
            time.sleep(0.05)
        assert registry.get_sample_value("interleaf_rpc_server_seconds_count", {**count, "code": "UNKNOWN"}) is None
    finally:
        server.stop(grace=None)


def test_a_failing_page_answers_500_without_its_detail():
    def broken(request):
        raise RuntimeError("/secret/path/of/the/coordinator")

    http = HttpServer({"/broken": broken}, "127.0.0.1", 0).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as failed:
            _get(f"http://127.0.0.1:{http.port}/broken")
        assert failed.value.code == 500
        body = failed.value.read().decode()
        assert "secret" not in body and "RuntimeError" not in body, body
    finally:
        http.stop()


def test_service_discovery_leaves_out_dead_servers():
    servers = Registry()
    alive = servers.register("127.0.0.1:7001", "", "cpu", 1 << 30, metrics_port=9001)
    servers.register("127.0.0.1:7002", "", "cpu", 1 << 30, metrics_port=9002)
    dead = next(e for e in servers.servers() if e.address == "127.0.0.1:7002")
    dead.last_seen -= DEAD_AFTER_S + 1
    assert [g["labels"]["server_id"] for g in service_discovery(servers)] == [alive]


def test_elastic_shrinks_and_growths_are_counted_and_the_replicas_follow_the_running_layout():
    """parallel.elastic: the replicas gauge follows each RUNNING status's layout; a
    recovery under a smaller layout counts a shrink (one that kept the layout does not),
    a GrowEvent a growth."""
    record = JobRecord("job-1-00001", load_config("", DATA_PARALLEL + ["parallel.elastic=true"]))
    metrics = CoordinatorMetrics(Registry(), lambda: [record])
    job = record.job_id

    def running(dp: int) -> None:
        record.ranks = [pb.RankInfo(rank=r, coordinates=pb.Coordinates(dp=r)) for r in range(dp)]
        record.set_state("RUNNING")

    running(2)
    record.add_recovery(pb.RecoveryEvent(attempt=1, lost=["a:1"], recover_seconds=1.0))  # replaced: same layout
    metrics.update()
    assert _counted(metrics, "interleaf_data_parallel_replicas", job) == 2
    assert _counted(metrics, "interleaf_elastic_shrinks_total", job) == 0
    running(1)
    record.add_recovery(pb.RecoveryEvent(attempt=2, lost=["b:2"], resized="parallel.elastic: dp=1, ..."))
    metrics.update()
    assert _counted(metrics, "interleaf_data_parallel_replicas", job) == 1
    assert _counted(metrics, "interleaf_elastic_shrinks_total", job) == 1
    running(2)
    record.add_grow(pb.GrowEvent(step=6, grid=pb.Coordinates(dp=2, pp=1, tp=1), seconds=1.5))
    metrics.update()
    assert _counted(metrics, "interleaf_data_parallel_replicas", job) == 2
    assert _counted(metrics, "interleaf_elastic_grows_total", job) == 1
    assert _counted(metrics, "interleaf_elastic_grow_seconds", job) == 1.5
    assert _counted(metrics, "interleaf_recoveries_total", job) == 2  # a growth is no recovery
