"""One flat fp32 buffer for a chunk's parameters and one for its gradients.

Parameters and their .grad become views into the flat buffers, so autograd accumulates
microbatch gradients straight into the buffer that the data-parallel all-reduce, the
norm and the optimizer then treat as one tensor (one collective per chunk, not one per
parameter; ZeRO shards the same buffers).
"""

from __future__ import annotations

import torch
from torch import nn


class FlatParams:
    def __init__(self, module: nn.Module, decays: dict[str, bool]):
        named = list(module.named_parameters())
        total = sum(p.numel() for _, p in named)
        self.names = [name for name, _ in named]
        self.data = torch.empty(total)
        self.grad = torch.zeros(total)
        self.decay_mask = torch.empty(total)
        self.offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, param in named:
            n = param.numel()
            self.offsets[name] = (offset, n)
            self.data[offset : offset + n].copy_(param.detach().reshape(-1))
            self.decay_mask[offset : offset + n] = 1.0 if decays[name] else 0.0
            param.data = self.data[offset : offset + n].view_as(param)
            param.grad = self.grad[offset : offset + n].view_as(param)
            offset += n
        self._params = dict(named)

    def view(self, name: str, buffer: torch.Tensor | None = None) -> torch.Tensor:
        """The slice of `buffer` (default: the parameters) that holds parameter `name`."""
        start, n = self.offsets[name]
        return (self.data if buffer is None else buffer)[start : start + n].view_as(self._params[name])

    def zero_grad(self) -> None:
        self.grad.zero_()

    def check_grads_in_place(self) -> None:
        """Autograd must have accumulated into the flat buffer, not replaced .grad."""
        for name, param in self._params.items():
            start, _ = self.offsets[name]
            if param.grad is None or param.grad.data_ptr() != self.grad[start:].data_ptr():
                raise RuntimeError(f"gradient of {name} left the flat buffer")
