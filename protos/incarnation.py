"""Which coordinator process a call comes from: its incarnation.

Each coordinator process draws a random incarnation id at start and sends it on every
call it makes to a stage server (gRPC metadata `interleaf-incarnation`, beside the
shared token of security.py, which says only that the caller is one of ours). A stage
server binds a job to the incarnation that set it up and refuses that job's control
calls from any other, so a coordinator that was replaced (restarted, or cut off while
its successor took over) cannot drive, save or tear down a job it no longer owns. A
caller that sends none (a test serving servers in process) is the incarnation "".
"""

from __future__ import annotations

import secrets

import grpc

from interleaf.protos.security import _CallDetails

HEADER = "interleaf-incarnation"


def new() -> str:
    return secrets.token_hex(8)


def of(context: grpc.ServicerContext) -> str:
    """The incarnation a call to this server came from ("" when none was sent)."""
    return dict(context.invocation_metadata() or ()).get(HEADER, "")


class AttachIncarnation(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                        grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds the incarnation to every call made on a channel, streams included."""

    def __init__(self, incarnation: str):
        self._header = (HEADER, incarnation)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] != HEADER] + [self._header]
        return _CallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    intercept_unary_stream = intercept_unary_unary
    intercept_stream_stream = intercept_stream_unary
