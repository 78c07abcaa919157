"""What a pipeline send carries between stages, and what the receiving compute uses.

Three cases, by how the tensor ranks of a stage hold the hidden states [b, s, d]:
  - plain: every tensor rank holds the whole (replicated) tensor and sends it whole to
    the same tensor rank of the next stage: tp copies of each message cross the link;
  - scatter/gather (Narayanan et al. 2021, section 4.1, "scatter/gather communication
    optimization"): the tensor is replicated, so tensor rank r sends only its r-th of it,
    flattened and cut into tp equal pieces as Megatron's
    split_tensor_into_1d_equal_chunks does, and the receiving stage's tensor ranks
    all-gather the pieces within their group (in the paper, over the fast links inside
    a node) before computing: each message crosses the link once;
  - sequence parallel: the ranks hold different slices of the sequence, [b, s/tp, d],
    and each sends its own: the same 1/tp bytes, with no gather at the receiver.
Which case a stage is in is message_mode (common/pipeline_message_modes.py), which
the coordinator's memory model reads too. Pure data movement: the gathered tensor is the one a rank would have received whole,
bit for bit (the ranks' copies are identical, being all-reduced).

Worked example, tp=2, b=1, s=4, d=2 in fp32 (a 32-byte message): plain sends 32 bytes
from each of the two tensor ranks; with scatter/gather rank 0 sends elements 0-3 and
rank 1 elements 4-7 (16 bytes each), and each receiver gathers 32 bytes within its
stage; sequence parallel sends tokens 0-1 from rank 0 and 2-3 from rank 1.
"""

from __future__ import annotations

import torch

from interleaf.common.pipeline_message_modes import MODES
from interleaf.stageserver.transport import Transport


class PipelineMessages:
    def __init__(self, mode: str, tp: Transport, rows: int, seq_len: int, d_model: int,
                 dtype: torch.dtype, device: torch.device):
        if mode not in MODES:
            raise ValueError(f"pipeline message mode {mode!r} must be one of {', '.join(MODES)}")
        self.mode, self.tp, self.dtype, self.device = mode, tp, dtype, device
        self.hidden = (rows, seq_len // tp.size if mode == "sequence_parallel" else seq_len, d_model)
        """The hidden states a compute takes and gives."""
        numel = rows * seq_len * d_model
        self.wire = (numel // tp.size,) if mode == "scatter_gather" else self.hidden
        """What one message carries."""

    def buffer(self) -> torch.Tensor:
        """An empty message, to receive into."""
        return torch.empty(self.wire, dtype=self.dtype, device=self.device)

    def outgoing(self, tensor: torch.Tensor, keep_whole: bool) -> torch.Tensor:
        """What to send of the hidden states (or their gradient) `tensor`. Scatter/
        gather: this rank's piece, a view where the whole stays alive anyway
        (`keep_whole`: an output kept for its backward), else a copy, so that the whole
        can be freed while the piece is in flight."""
        if self.mode != "scatter_gather":
            return tensor
        piece = tensor.reshape(-1).chunk(self.tp.size)[self.tp.rank]
        return piece if keep_whole else piece.clone()

    def incoming(self, message: torch.Tensor) -> torch.Tensor:
        """The hidden states a received message stands for. Scatter/gather: the tensor
        group's pieces all-gathered (every rank of the group takes the same message at
        the same action of the same program, so the collective lines up)."""
        if self.mode != "scatter_gather":
            return message
        whole = torch.empty(self.hidden, dtype=self.dtype, device=self.device)
        self.tp.all_gather(whole.view(-1), message)
        return whole
