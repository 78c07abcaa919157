"""Requests that do not parse are refused as INVALID_ARGUMENT, naming the method and the
message it expected.

Left to itself, gRPC answers bytes that are not the method's request message (a broken
or hostile client, a string field holding invalid UTF-8) with INTERNAL "Exception
deserializing request!", the code of a server bug. This interceptor takes the parsing
into the handler: the server hands it the raw bytes, it parses them with the method's
own deserializer and aborts with INVALID_ARGUMENT when they are not that message.

It also keeps every status message a handler aborts with to MAX_DETAILS_CHARS: messages
echo the value they refuse, which may be as long as a request allows, and gRPC carries
the message in a trailer that clients refuse beyond 8 KiB (then reporting INTERNAL).
"""

from __future__ import annotations

import grpc
from google.protobuf.message import DecodeError

MAX_DETAILS_CHARS = 1024

_MAKE = {
    (False, False): (grpc.unary_unary_rpc_method_handler, "unary_unary"),
    (False, True): (grpc.unary_stream_rpc_method_handler, "unary_stream"),
    (True, False): (grpc.stream_unary_rpc_method_handler, "stream_unary"),
    (True, True): (grpc.stream_stream_rpc_method_handler, "stream_stream"),
}


class RefuseMalformed(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize, method = handler.request_deserializer, handler_call_details.method
        expected = getattr(getattr(deserialize, "__self__", None), "DESCRIPTOR", None)
        expected = expected.full_name if expected is not None else "request"

        def parse(raw: bytes, context: "_Bounded"):
            try:
                return deserialize(raw)
            except (DecodeError, ValueError, TypeError) as err:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"{method}: {len(raw)} request bytes are not a {expected} message ({err})")

        make, kind = _MAKE[(handler.request_streaming, handler.response_streaming)]
        behavior = getattr(handler, kind)
        if handler.request_streaming:
            def wrapped(raw_requests, context):
                context = _Bounded(context)
                return behavior((parse(raw, context) for raw in raw_requests), context)
        else:
            def wrapped(raw, context):
                context = _Bounded(context)
                return behavior(parse(raw, context), context)
        return make(wrapped, request_deserializer=None, response_serializer=handler.response_serializer)


def shortened(details: str) -> str:
    if len(details) <= MAX_DETAILS_CHARS:
        return details
    return f"{details[:MAX_DETAILS_CHARS - 40]}... ({len(details)} characters)"


class _Bounded:
    """The handler's context, with status messages shortened to MAX_DETAILS_CHARS."""

    def __init__(self, context):
        self._context = context

    def abort(self, code, details):
        self._context.abort(code, shortened(details))

    def set_details(self, details):
        self._context.set_details(shortened(details))

    def __getattr__(self, name):
        return getattr(self._context, name)
