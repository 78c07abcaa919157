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

from interleaf.common.security import AttachHeader

HEADER = "interleaf-incarnation"


def new() -> str:
    return secrets.token_hex(8)


def of(context: grpc.ServicerContext) -> str:
    """The incarnation a call to this server came from ("" when none was sent)."""
    return dict(context.invocation_metadata() or ()).get(HEADER, "")


def AttachIncarnation(incarnation: str) -> AttachHeader:  # noqa: N802 - named as the interceptor it makes
    """Adds the incarnation to every call made on a channel, streams included."""
    return AttachHeader(HEADER, incarnation)
