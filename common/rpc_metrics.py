"""RPC latency of a gRPC server, by method and status code, as a Prometheus histogram.

A server interceptor wraps every method's handler: a unary call is timed from the
handler's start to its return, a streaming one until its last message is sent (a
RunSteps stream: the whole block of steps). Installed first, outside the token check,
so refused calls are counted too (code UNAUTHENTICATED). A call its client gave up on
(a watcher that stops following, a RunSteps stream of a torn-down job) is counted
CANCELLED, or DEADLINE_EXCEEDED when its deadline passed, rather than UNKNOWN or OK.
"""

from __future__ import annotations

import time

import grpc
from prometheus_client import CollectorRegistry, Histogram

# From a heartbeat on loopback (~100 µs) to a RunSteps block or a NCCL connect (minutes).
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class RpcLatency(grpc.ServerInterceptor):
    def __init__(self, registry: CollectorRegistry):
        self.seconds = Histogram(
            "interleaf_rpc_server_seconds",
            "Wall time this process's gRPC server spent on each call it answered, from the handler's start to "
            "its reply (streaming replies: to the last message), by method and gRPC status code.",
            ["method", "code"], registry=registry, buckets=BUCKETS)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(handler.unary_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(handler.stream_unary, method), handler.request_deserializer, handler.response_serializer)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(handler.unary_stream, method), handler.request_deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(handler.stream_stream, method), handler.request_deserializer, handler.response_serializer)

    def _observe(self, method: str, context, started: float, failed: bool) -> None:
        code = context.code() if hasattr(context, "code") else None
        # The client went away: the handler failed writing to it, or (a watcher's stream,
        # which follows while context.is_active()) ended because of it.
        if code is None and not context.is_active():
            remaining = context.time_remaining()
            code = grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 \
                else grpc.StatusCode.CANCELLED
        if code is None:
            code = grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK
        self.seconds.labels(method, code.name).observe(time.perf_counter() - started)

    def _unary(self, behavior, method: str):
        def timed(request, context):
            started, failed = time.perf_counter(), True
            try:
                reply = behavior(request, context)
                failed = False
                return reply
            finally:
                self._observe(method, context, started, failed)
        return timed

    def _stream(self, behavior, method: str):
        def timed(request, context):
            started, failed = time.perf_counter(), True
            try:
                yield from behavior(request, context)
                failed = False
            finally:
                self._observe(method, context, started, failed)
        return timed
