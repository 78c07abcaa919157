"""Where tensors cross the network: one Transport object per communication group."""

from interleaf.stageserver.transport.base import Transport, Work
from interleaf.stageserver.transport.gloo import GlooTransport, connect_gloo
from interleaf.stageserver.transport.solo import SoloTransport

__all__ = ["Transport", "Work", "GlooTransport", "SoloTransport", "connect_gloo"]
