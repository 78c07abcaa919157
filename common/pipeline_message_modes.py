"""How a pipeline send between stages is cut, by how the tensor ranks of a stage hold
the hidden states: plain, scatter/gather or sequence parallel (the three cases and a
worked example are stageserver/pipeline_messages.py's, which moves them). The stage
servers and the coordinator's memory model pick the case alike."""

from __future__ import annotations

MODES = ("plain", "scatter_gather", "sequence_parallel")


def message_mode(tp_size: int, sequence_parallel: bool, scatter_gather: bool) -> str:
    """The case for a stage of `tp_size` tensor ranks (with one, all three are plain)."""
    if tp_size == 1:
        return "plain"
    if sequence_parallel:
        return "sequence_parallel"
    return "scatter_gather" if scatter_gather else "plain"
