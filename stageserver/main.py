"""`interleaf stage-server`: serve the StageServer API and stay registered with the
coordinator (register, heartbeat, and register again if the coordinator forgot us)."""

from __future__ import annotations

import logging
import pathlib
import signal
import threading

import grpc
import torch

from protos import interleaf_pb2 as pb
from protos import interleaf_pb2_grpc as rpc
from protos import wire
from stageserver.device import device_memory_bytes, resolve_device
from stageserver.service import StageServerService
from stageserver.spool import default_root

log = logging.getLogger("interleaf.stageserver")
RPC_TIMEOUT_S = 10.0


class Registrar(threading.Thread):
    def __init__(self, coordinator: str, address: str, host: str, stop: threading.Event, memory_bytes: int,
                 device: str):
        super().__init__(name="registrar", daemon=True)
        self.stub = rpc.CoordinatorStub(wire.channel(coordinator))
        self.request = pb.RegisterRequest(
            address=address, host=host, device=device, memory_bytes=memory_bytes
        )
        self.stop = stop
        self.server_id = ""

    def run(self) -> None:
        interval = 1.0
        while not self.stop.is_set():
            try:
                if not self.server_id:
                    reply = self.stub.RegisterServer(self.request, timeout=RPC_TIMEOUT_S)
                    self.server_id, interval = reply.server_id, reply.heartbeat_interval_s
                    log.info("registered as %s", self.server_id)
                else:
                    self.stub.Heartbeat(pb.HeartbeatRequest(server_id=self.server_id), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                if err.code() == grpc.StatusCode.NOT_FOUND:
                    self.server_id = ""  # the coordinator restarted: register again
                    continue
                log.warning("coordinator unreachable: %s", err.details())
            self.stop.wait(interval)


def serve(coordinator: str, host: str, port: int, bind: str, threads: int, memory_bytes: int = 0,
          device: str = "cpu", spool_dir: str | None = None) -> None:
    if threads > 0:
        torch.set_num_threads(threads)
    where = resolve_device(device)
    if where.type == "cuda":
        torch.cuda.set_device(where)  # this thread's; the gRPC handlers set it on theirs
    server = wire.server()
    rpc.add_StageServerServicer_to_server(StageServerService(host, where, pathlib.Path(spool_dir) if spool_dir else default_root()), server)
    bound = server.add_insecure_port(f"{bind}:{port}")
    server.start()
    stop = threading.Event()
    Registrar(coordinator, f"{host}:{bound}", host, stop, memory_bytes or device_memory_bytes(where),
              str(where)).start()
    log.info("stage server on %s:%d (%s), coordinator %s", host, bound, where, coordinator)

    def shutdown(*_):
        stop.set()
        server.stop(grace=1.0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    server.wait_for_termination()
