"""The one place gRPC channels and servers are made: the settings every endpoint shares.

Messages carry programs and reports, never tensors, but a long program for many
microbatches can pass gRPC's 4 MiB default, so the limit is raised on both ends.

Every channel and server carries a `Security` (protos/security.py): the shared token
and TLS. A process has one identity, set once at its start (`configure`, from its
command line); channels and servers made without a `Security` of their own take it,
so code deep in a server (a job's driver calling stage servers) needs no plumbing.
Unconfigured, it is $INTERLEAF_TOKEN's token, without TLS.
"""

from __future__ import annotations

from concurrent import futures

import grpc

from interleaf.protos.security import AttachToken, RequireToken, Security

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


_configured: Security | None = None


def configure(security: Security) -> None:
    """Sets this process's security: what every channel and server made without one carries."""
    global _configured
    _configured = security


def current() -> Security:
    return _configured if _configured is not None else Security.from_options()


def channel(address: str, security: Security | None = None) -> grpc.Channel:
    security = current() if security is None else security
    if security.calls_tls:
        made = grpc.secure_channel(address, security.channel_credentials(), options=OPTIONS)
    else:
        made = grpc.insecure_channel(address, options=OPTIONS)
    return grpc.intercept_channel(made, AttachToken(security.token)) if security.token else made


def server(threads: int = 16, security: Security | None = None) -> grpc.Server:
    """A server that refuses calls without the token (when there is one). Bind it with `listen`."""
    security = current() if security is None else security
    interceptors = [RequireToken(security.token)] if security.token else []
    return grpc.server(futures.ThreadPoolExecutor(max_workers=threads), interceptors=interceptors, options=OPTIONS)


def listen(server: grpc.Server, address: str, security: Security | None = None) -> int:
    """Binds `server` to `address` (HOST:PORT; port 0 picks one), over TLS when the
    security has a certificate; returns the port bound."""
    security = current() if security is None else security
    if security.serves_tls:
        return server.add_secure_port(address, security.server_credentials())
    return server.add_insecure_port(address)
