"""The one place gRPC channels and servers are made: the settings every endpoint shares.

Messages carry programs and reports, never tensors. Every endpoint sends up to
MAX_MESSAGE_BYTES, and a channel (what a caller accepts back: step reports with traced
spans, checkpoint files in 1 MiB pieces) receives as much. What a server accepts is
bounded by what its service is sent, and gRPC refuses a larger message with
RESOURCE_EXHAUSTED before any handler runs:

- the coordinator, COORDINATOR_RECEIVE_BYTES: its largest request is a SubmitJob, whose
  config text and overrides the handler holds to MAX_CONFIG_BYTES each (INVALID_ARGUMENT
  beyond); every other request is a few ids;
- a stage server, STAGE_SERVER_RECEIVE_BYTES: its largest request is a Setup with the
  rank's program, a few MiB at the config's bounds (common/limits.py), and file
  pieces of 1 MiB.

A request that is not its method's message is refused with INVALID_ARGUMENT
(common/malformed.py), never with gRPC's INTERNAL.

Every channel and server carries a `Security` (common/security.py): the shared token
and TLS. A process has one identity, set once at its start (`configure`, from its
command line); channels and servers made without a `Security` of their own take it,
so code deep in a server (a job's driver calling stage servers) needs no plumbing.
Unconfigured, it is $INTERLEAF_TOKEN's token, without TLS. A coordinator process also
sets its incarnation (`identify`, common/incarnation.py), which its channels carry too.
"""

from __future__ import annotations

from concurrent import futures

import grpc

from interleaf.common.malformed import RefuseMalformed
from interleaf.common.incarnation import AttachIncarnation
from interleaf.common.security import AttachToken, RequireToken, Security

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
MAX_CONFIG_BYTES = 1 << 20
"""SubmitJob: at most this many bytes of config text, and as many of overrides in all."""
COORDINATOR_RECEIVE_BYTES = 4 * MAX_CONFIG_BYTES
MAX_PROFILE_BYTES = 64 << 20
"""One rank's torch profile or memory snapshot of a traced step, gzip-compressed, at
most (about 640 MiB of Chrome trace JSON): a stage server drops a larger one, and the
coordinator keeps none larger, each with a note naming its size (StepTrace.profile_notes),
so a step report carrying both, and GetTrace's reply of one rank's, stay under
MAX_MESSAGE_BYTES."""
STAGE_SERVER_RECEIVE_BYTES = 64 << 20
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


_configured: Security | None = None
_incarnation = ""


def configure(security: Security) -> None:
    """Sets this process's security: what every channel and server made without one carries."""
    global _configured
    _configured = security


def identify(incarnation: str) -> None:
    """Sets the coordinator incarnation every channel of this process sends."""
    global _incarnation
    _incarnation = incarnation


def current() -> Security:
    return _configured if _configured is not None else Security.from_options()


def channel(address: str, security: Security | None = None) -> grpc.Channel:
    security = current() if security is None else security
    if security.calls_tls:
        made = grpc.secure_channel(address, security.channel_credentials(), options=OPTIONS)
    else:
        made = grpc.insecure_channel(address, options=OPTIONS)
    if _incarnation:
        made = grpc.intercept_channel(made, AttachIncarnation(_incarnation))
    return grpc.intercept_channel(made, AttachToken(security.token)) if security.token else made


def server(threads: int = 16, security: Security | None = None, interceptors: tuple = (),
           max_receive_bytes: int = MAX_MESSAGE_BYTES) -> grpc.Server:
    """A server that refuses calls without the token (when there is one), requests
    larger than `max_receive_bytes` and requests that do not parse. Bind it with
    `listen`. `interceptors` (e.g. common/rpc_metrics.py's) run before the token check."""
    security = current() if security is None else security
    chain = [*interceptors, *([RequireToken(security.token)] if security.token else []), RefuseMalformed()]
    options = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", max_receive_bytes)]
    return grpc.server(futures.ThreadPoolExecutor(max_workers=threads), interceptors=chain, options=options)


def listen(server: grpc.Server, address: str, security: Security | None = None) -> int:
    """Binds `server` to `address` (HOST:PORT; port 0 picks one), over TLS when the
    security has a certificate; returns the port bound."""
    security = current() if security is None else security
    if security.serves_tls:
        return server.add_secure_port(address, security.server_credentials())
    return server.add_insecure_port(address)
