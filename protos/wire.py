"""Transport settings every gRPC endpoint in Interleaf shares.

Messages carry programs and reports, never tensors, but a long program for many
microbatches can pass gRPC's 4 MiB default, so the limit is raised on both ends.
"""

from __future__ import annotations

from concurrent import futures

import grpc

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]


def channel(address: str) -> grpc.Channel:
    return grpc.insecure_channel(address, options=OPTIONS)


def server(threads: int = 16) -> grpc.Server:
    return grpc.server(futures.ThreadPoolExecutor(max_workers=threads), options=OPTIONS)
