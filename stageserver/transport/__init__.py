"""Where tensors cross the network: one Transport object per communication group."""

from stageserver.transport.base import Transport, Work
from stageserver.transport.gloo import GlooTransport, connect_gloo
from stageserver.transport.solo import SoloTransport

__all__ = ["Transport", "Work", "GlooTransport", "SoloTransport", "connect_gloo"]
