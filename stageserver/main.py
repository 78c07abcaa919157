"""`interleaf stage-server`: serve the StageServer API and stay registered with the
coordinator (register, heartbeat, and register again if the coordinator forgot us).

A server outlives no purpose. A job whose coordinator forgot us (it restarted) or has
been unreachable past --orphan-timeout is dropped: closed as Teardown would. SIGTERM
and SIGINT drop the job, whose step stops at its next action, and end the process: once
the calls have ended, or after their grace (EXIT_GRACE_S) where a step still runs (in
a long action, or waiting on a peer), and within EXIT_BOUND_S whatever else holds on.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time

import grpc
import torch

from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.common.health import STAGE_SERVER, Health
from interleaf.common.http import HttpServer, metrics_route
from interleaf.common.rpc_metrics import RpcLatency
from interleaf.common.security import Security
from interleaf.stageserver.device import default_peak_flops, device_memory_bytes, resolve_device
from interleaf.stageserver.metrics import StageMetrics
from interleaf.stageserver.service import StageServerService
from interleaf.stageserver.spool import default_root

log = logging.getLogger("interleaf.stageserver")
RPC_TIMEOUT_S = 10.0
ORPHAN_TIMEOUT_S = 30.0
"""--orphan-timeout's default: the coordinator's silence after which a job is dropped."""
EXIT_GRACE_S = 1.0
"""After a signal, how long RPCs in flight (a RunSteps told its job was cancelled) get
to end before the gRPC server cancels them."""
EXIT_BOUND_S = 5.0
"""After a signal the process is gone within this, whatever still holds on. No
cancellation reaches a receive or a collective already posted, on a peer that hangs
(alive, not answering) or one that is gone: gloo does not always end a wait posted
before its peer died (under load, 4 of 33 runs of the test of this left a stage server
waiting out the whole bound). A step still running when the calls' grace (EXIT_GRACE_S)
ends is left at once; this bounds the rest (a save, a communicator's close), which the
interpreter would join at exit."""


class Registrar(threading.Thread):
    def __init__(self, coordinator: str, address: str, host: str, stop: threading.Event, memory_bytes: int,
                 device: str, service: StageServerService, orphan_timeout_s: float = ORPHAN_TIMEOUT_S,
                 metrics_port: int = 0, peak_flops: float = 0.0, health: Health | None = None):
        super().__init__(name="registrar", daemon=True)
        self.health = health
        self.coordinator = coordinator
        self._connect()
        self.request = pb.RegisterRequest(
            address=address, host=host, device=device, memory_bytes=memory_bytes, metrics_port=metrics_port,
            peak_flops=peak_flops,
        )
        self.stop = stop
        self.service = service
        self.orphan_timeout_s = orphan_timeout_s
        self.server_id = ""
        self.last_contact = time.monotonic()

    def run(self) -> None:
        interval = 1.0
        while not self.stop.is_set():
            try:
                if not self.server_id:
                    reply = self.stub.RegisterServer(self.request, timeout=RPC_TIMEOUT_S)
                    self.server_id, interval = reply.server_id, reply.heartbeat_interval_s
                    log.info("registered as %s with coordinator incarnation %s", self.server_id, reply.incarnation)
                    self.service.adopt(reply.incarnation)
                else:
                    self.stub.Heartbeat(pb.HeartbeatRequest(server_id=self.server_id), timeout=RPC_TIMEOUT_S)
                self.last_contact = time.monotonic()
                self._ready(True)  # registered, and the coordinator answers
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    # The coordinator restarted: a job it gave us is no one's now, and
                    # holding it would refuse the next one ("busy").
                    self.service.drop_job("the coordinator no longer knows this server (it restarted)")
                    self.server_id = ""
                    self._ready(False)
                    continue
                self._unreachable(err)
            self.stop.wait(interval)

    def _unreachable(self, err: grpc.RpcError) -> None:
        silent = time.monotonic() - self.last_contact
        if err.code() == grpc.StatusCode.UNAUTHENTICATED:  # as good as unreachable, but ours to fix
            log.error("the coordinator refuses this server's token (for %.0f s): %s", silent, err.details())
        else:
            log.warning("coordinator unreachable for %.0f s: %s", silent, err.details())
        if silent > self.orphan_timeout_s:
            self._ready(False)
            self.service.drop_job(f"the coordinator has been unreachable for {silent:.0f} s "
                                  f"(--orphan-timeout {self.orphan_timeout_s:g})")
        # A fresh channel tries at once: gRPC's reconnection backoff would otherwise grow
        # to minutes and find a restarted coordinator late.
        self.channel.close()
        self._connect()

    def _ready(self, ready: bool) -> None:
        if self.health is None:
            return
        if ready:
            self.health.ready()
        else:
            self.health.unready()

    def _connect(self) -> None:
        self.channel = wire.channel(self.coordinator)
        self.stub = rpc.CoordinatorStub(self.channel)


def serve(coordinator: str, host: str, port: int, bind: str, threads: int, memory_bytes: int = 0,
          device: str = "cpu", spool_dir: str | None = None, orphan_timeout_s: float = ORPHAN_TIMEOUT_S,
          security: Security | None = None, metrics_port: int = 0, peak_flops: float = 0.0) -> None:
    if security is not None:  # set first: the registrar's channel to the coordinator takes it.
        wire.configure(security)
    if threads > 0:
        torch.set_num_threads(threads)
    where = resolve_device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)  # this thread's; the gRPC handlers set it on theirs
    peak_flops = peak_flops or default_peak_flops(where)
    # metrics_port -1: no metrics at all, for those who do not want them and to measure
    # what they cost (bench/observability_cost.py): no HTTP server, no RPC timing, no
    # communication metering; the server registers with metrics port 0, which /sd skips.
    observed = metrics_port >= 0
    metrics = StageMetrics(peak_flops=peak_flops) if observed else None
    server = wire.server(interceptors=(RpcLatency(metrics.registry),) if observed else (),
                         max_receive_bytes=wire.STAGE_SERVER_RECEIVE_BYTES)
    service = StageServerService(host, where, pathlib.Path(spool_dir) if spool_dir else default_root(), metrics,
                                 observed=observed)
    rpc.add_StageServerServicer_to_server(service, server)
    health = Health(server, STAGE_SERVER)  # SERVING once registered
    bound = wire.listen(server, f"{bind}:{port}")
    server.start()
    http_port = 0  # what a server without metrics registers with: /sd leaves it out
    if observed:
        http_port = HttpServer({"/metrics": metrics_route(metrics.registry)}, bind, metrics_port).start().port
    stop = threading.Event()
    Registrar(coordinator, f"{host}:{bound}", host, stop, memory_bytes or device_memory_bytes(where),
              str(where), service, orphan_timeout_s, http_port, peak_flops, health).start()
    log.info("stage server on %s:%d (%s), %s, coordinator %s, orphan timeout %g s", host, bound, where,
             f"metrics on http://{host}:{http_port}/metrics" if observed else "metrics off", coordinator,
             orphan_timeout_s)

    signalled: list[int] = []

    def shutdown(signum, _frame):
        # A second signal can interrupt this handler anywhere, even inside stop.set()
        # holding the Event's lock, which the nested handler would then wait for on this
        # same thread for ever. So the first thing done, and the only thing read, is a
        # list append, which takes no lock; and the hard stop is armed before anything
        # that may wait (stop.set, health, closing the job: an NCCL close gives its
        # operations a grace period).
        if signalled:  # a second signal: no more waiting
            _exit_now(signum)
        signalled.append(signum)
        hard_stop = threading.Timer(EXIT_BOUND_S, _exit_now, args=(signum, f"still busy {EXIT_BOUND_S:g} s"))
        hard_stop.daemon = True
        hard_stop.start()
        stop.set()
        health.stopping()  # a health watcher sees the drain before the stream ends
        name = signal.Signals(signum).name
        log.info("%s: stopping (gone within %g s)", name, EXIT_BOUND_S)
        service.drop_job(f"the server got {name}")
        server.stop(grace=EXIT_GRACE_S)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    server.wait_for_termination()
    if signalled and service.working():
        # The job is dropped and its step was to stop at its next action. One still
        # running after the calls' grace waits on a peer that hangs or is gone (gloo does
        # not always end a wait posted before its peer died), or is in an action longer
        # than the grace. Its result has no one to go to, and the interpreter would join
        # its thread.
        _exit_now(signalled[0], f"a step still running {EXIT_GRACE_S:g} s")


def _exit_now(signum: int, why: str = "a second signal") -> None:
    """Ends the process without joining its threads (a handler thread waiting on a peer
    that is gone would hold the interpreter's exit until the communication timeout)."""
    log.warning("%s after %s: exiting now", why, signal.Signals(signum).name)
    logging.shutdown()
    os._exit(128 + signum)
