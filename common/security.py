"""Who may call whom: a shared token on every RPC, and TLS (mutual when asked) on the wire.

Every gRPC endpoint in Interleaf (the coordinator, each stage server, and each of them
as the other's client) is made in `wire.py` from one `Security`:

- a token: every call carries `authorization: Bearer TOKEN`; a server with a token
  refuses, with UNAUTHENTICATED and before any handler runs (or the request is even
  parsed), a call without it or with another one. One method alone is exempt: the
  standard health service's Check (`UNGUARDED_METHODS`), which Kubernetes' gRPC probes
  call without any metadata; it tells only whether the server is serving;
- TLS: a process with a certificate serves TLS; one with a CA (or a certificate of
  its own) calls over TLS, verifying the server against that CA and presenting its
  certificate to servers that ask for one; a server with a client CA asks, and refuses
  a caller without a certificate that CA signed (mutual TLS).

With neither, every call is accepted in plaintext: for trusted networks only.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import os
import pathlib
from dataclasses import dataclass

import grpc

TOKEN_ENV = "INTERLEAF_TOKEN"
HEADER = "authorization"
UNGUARDED_METHODS = frozenset({"/grpc.health.v1.Health/Check"})
"""The only methods a server with a token answers without it. Health Check reveals a
serving status and nothing else, takes no resource a caller could hold (a unary call),
and is what a Kubernetes `grpc:` probe sends, with no way to add a token. The health
service's Watch (a stream) still needs the token."""
FLAGS = {"cert": "--tls-cert", "key": "--tls-key", "ca": "--tls-ca", "client_ca": "--tls-client-ca"}
"""Each certificate field's command-line flag, as errors name it."""


class SecurityError(ValueError):
    """A token or certificate setting that cannot work; the message names the flag."""


@dataclass(frozen=True)
class Security:
    token: str = ""
    """The shared token every call carries and every server requires ('': none)."""
    cert: str = ""
    """PEM certificate chain of this process: its server serves TLS with it, and it is
    presented when calling a server that requires clients' certificates."""
    key: str = ""
    """PEM private key of `cert`."""
    ca: str = ""
    """PEM CA certificates that verify the servers this process calls."""
    client_ca: str = ""
    """PEM CA certificates; a server given them requires every caller to present a
    certificate they signed (mutual TLS)."""

    def __post_init__(self):
        if self.token and not (self.token.isascii() and self.token.isprintable() and self.token.strip() == self.token):
            raise SecurityError(f"the token (${TOKEN_ENV} or --token-file) must be printable ASCII without "
                                "surrounding whitespace: it travels as gRPC metadata")
        if bool(self.cert) != bool(self.key):
            raise SecurityError("--tls-cert and --tls-key go together: a certificate needs its key")
        if self.client_ca and not self.cert:
            raise SecurityError("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        for name, flag in FLAGS.items():
            path = getattr(self, name)
            if not path:
                continue
            try:
                pem = _read(path)
            except OSError as err:
                raise SecurityError(f"{flag} {path!r}: {err.strerror}") from None
            # Checked here: gRPC's own answer to a bad file is "failed to bind".
            what, marker = ("private key", b"PRIVATE KEY-----") if name == "key" else \
                ("certificate", b"-----BEGIN CERTIFICATE-----")
            if marker not in pem:
                raise SecurityError(f"{flag} {path!r} holds no PEM {what}")

    @classmethod
    def from_options(cls, token_file: str | None = None, cert: str | None = None, key: str | None = None,
                     ca: str | None = None, client_ca: str | None = None, environ=os.environ) -> "Security":
        """The token from `token_file` if given, else from $INTERLEAF_TOKEN: never from a
        command line, where any user of the machine can read it (/proc/PID/cmdline)."""
        token = environ.get(TOKEN_ENV, "").strip()
        if token_file:
            try:
                token = pathlib.Path(token_file).read_text().strip()
            except OSError as err:
                raise SecurityError(f"--token-file {token_file!r}: {err.strerror}") from None
            if not token:
                raise SecurityError(f"--token-file {token_file!r} is empty")
        return cls(token, cert or "", key or "", ca or "", client_ca or "")

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)

    @property
    def calls_tls(self) -> bool:
        return bool(self.ca or self.cert)

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(_read(self.key), _read(self.cert))],
            root_certificates=_read(self.client_ca) if self.client_ca else None,
            require_client_auth=bool(self.client_ca),
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca) if self.ca else None,  # None: the system's roots
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None,
        )

    def tls_flags(self) -> list[str]:
        """The command-line flags that give a child process these certificates (the
        token goes by its environment instead)."""
        return [arg for name, flag in FLAGS.items() if getattr(self, name) for arg in (flag, getattr(self, name))]


def _read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


class _CallDetails(collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                                           "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class AttachHeader(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds one metadata header (replacing any of that name) to every call made on a
    channel, streams included."""

    def __init__(self, name: str, value: str):
        self._name, self._header = name, (name, value)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] != self._name] + [self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    intercept_unary_stream = intercept_unary_unary
    intercept_stream_stream = intercept_stream_unary


def AttachToken(token: str) -> AttachHeader:  # noqa: N802 - named as the interceptor it makes
    """Adds the token to every call made on a channel, streams included."""
    return AttachHeader(HEADER, f"Bearer {token}")


class RequireToken(grpc.ServerInterceptor):
    """Lets through only calls that carry the token. The comparison takes the same time
    wherever a wrong token differs, and whatever its length (both sides hashed first), so
    timing the refusals tells a caller nothing about the token."""

    def __init__(self, token: str):
        self._expected = _digest(f"Bearer {token}")

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method in UNGUARDED_METHODS:
            return continuation(handler_call_details)
        presented = dict(handler_call_details.invocation_metadata or ()).get(HEADER)
        if presented is not None and hmac.compare_digest(_digest(presented), self._expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:  # no such method: gRPC answers UNIMPLEMENTED, telling nothing
            return None
        method = handler_call_details.method
        if presented is None:
            why = (f"{method}: no token; this server requires the shared token "
                   f"(set ${TOKEN_ENV} or pass --token-file)")
        else:
            why = f"{method}: wrong token; the caller's token is not this server's"
        return _refusal(handler, why)


def _digest(header) -> bytes:
    data = header if isinstance(header, bytes) else str(header).encode()
    return hashlib.sha256(data).digest()


def _refusal(handler: grpc.RpcMethodHandler, why: str) -> grpc.RpcMethodHandler:
    """A handler of the refused method's own kind that only aborts. With no request
    deserializer, the caller's bytes are never parsed."""

    def refuse(_request, context):
        context.abort(grpc.StatusCode.UNAUTHENTICATED, why)

    make = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }[(handler.request_streaming, handler.response_streaming)]
    return make(refuse, response_serializer=handler.response_serializer)
