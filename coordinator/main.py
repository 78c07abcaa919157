"""`interleaf coordinator`: serve the Coordinator API and host the gloo rendezvous store."""

from __future__ import annotations

import datetime
import logging
import signal

import torch.distributed as dist

from interleaf.coordinator.service import SERVER_THREADS, CoordinatorService
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.protos import wire
from interleaf.protos.security import Security

log = logging.getLogger("interleaf.coordinator")


def serve(host: str, port: int, bind: str, store_port: int, steps_per_call: int = 8,
          security: Security | None = None) -> None:
    if security is not None:  # set first: the drivers' channels to stage servers take it.
        wire.configure(security)
    # Stage servers rendezvous here to build their gloo groups; each job attempt uses
    # its own key prefix, so one store serves every job.
    store = dist.TCPStore(
        bind, store_port, is_master=True, wait_for_workers=False,
        timeout=datetime.timedelta(seconds=300),
    )
    service = CoordinatorService((host, store.port), steps_per_call)
    server = wire.server(threads=SERVER_THREADS)
    rpc.add_CoordinatorServicer_to_server(service, server)
    bound = wire.listen(server, f"{bind}:{port}")
    server.start()
    print(f"coordinator listening on {host}:{bound} (rendezvous store on port {store.port})", flush=True)

    def shutdown(*_):
        server.stop(grace=1.0)

    signal.signal(signal.SIGTERM, shutdown)
    signal.signal(signal.SIGINT, shutdown)
    server.wait_for_termination()
