"""`interleaf coordinator`: serve the Coordinator API and host the gloo rendezvous store.

Job state lives in the SQLite database of --state-db (coordinator/job_store.py): started
again on it, a coordinator resumes the jobs it held. It keeps the newest --keep-jobs
finished jobs; older ones are pruned as jobs finish. Each process has a fresh random
incarnation, sent on its calls to stage servers (common/incarnation.py)."""

from __future__ import annotations

import datetime
import logging
import signal

import torch.distributed as dist

from interleaf.coordinator import executed_step
from interleaf.coordinator.http_server import serve_http
from interleaf.coordinator.job_store import DEFAULT_KEEP_JOBS, JobStore, default_path
from interleaf.coordinator.metrics import CoordinatorMetrics
from interleaf.coordinator.service import SERVER_THREADS, CoordinatorService
from interleaf.common import incarnation
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.health import COORDINATOR, Health
from interleaf.common.rpc_metrics import RpcLatency
from interleaf.common.security import Security

log = logging.getLogger("interleaf.coordinator")


def serve(host: str, port: int, bind: str, store_port: int, steps_per_call: int = 8,
          security: Security | None = None, *, state_db: str = "", http_port: int = 50052,
          keep_jobs: int = DEFAULT_KEEP_JOBS) -> None:
    # First: refused (in use, unwritable, a bad --keep-jobs) before anything starts.
    jobs = JobStore(state_db or default_path(), keep_jobs)
    if security is not None:  # set first: the drivers' channels to stage servers take it.
        wire.configure(security)
    me = incarnation.new()
    wire.identify(me)
    # Stage servers rendezvous here to build their gloo groups; each job attempt uses
    # its own key prefix, so one store serves every job.
    store = dist.TCPStore(
        bind, store_port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=300),
    )
    service = CoordinatorService((host, store.port), steps_per_call, jobs, me)
    metrics = CoordinatorMetrics(service.registry, lambda: [d.job for d in list(service.drivers.values())])
    service.jobs.on_pruned(metrics.forget)
    server = wire.server(threads=SERVER_THREADS, max_receive_bytes=wire.COORDINATOR_RECEIVE_BYTES,
                         interceptors=(RpcLatency(metrics.registry),))
    rpc.add_CoordinatorServicer_to_server(service, server)
    health = Health(server, COORDINATOR)
    bound = wire.listen(server, f"{bind}:{port}")
    service.resume_jobs()  # before serving: a call naming a resumed job finds its driver
    server.start()
    http = serve_http(metrics, service.registry, bind, http_port, address=f"{host}:{bound}",
                      draw_trace=executed_step.figure)
    health.ready()
    print(f"coordinator listening on {host}:{bound} (rendezvous store on port {store.port}, metrics and "
          f"service discovery on http://{host}:{http.port})", flush=True)
    log.info("incarnation %s, job state in %s (keeping the newest %d finished jobs)", me, jobs.path, keep_jobs)

    signalled: list[int] = []

    def shutdown(signum, _frame):
        # Once: a second signal interrupting this handler (inside a lock health.stopping
        # or server.stop holds) would wait for that lock on this same thread for ever.
        # A list append takes none. The first signal's stop is bounded by its grace.
        if signalled:
            return
        signalled.append(signum)
        health.stopping()  # a health watcher sees the drain before the stream ends
        server.stop(grace=1.0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    try:
        server.wait_for_termination()
    finally:
        service.close_job_logs()
