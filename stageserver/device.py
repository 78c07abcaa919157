"""Where a stage server computes: `--device auto|cpu|cuda|cuda:N`.

auto takes the GPU when torch sees one. A server on a GPU offers that GPU's memory to
jobs (the coordinator's admission check counts device bytes there); a CPU server offers
the machine's memory, or its share when several local servers run on one machine.
"""

from __future__ import annotations

import os

import torch


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise ValueError(f"--device={spec!r} must be auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device={spec!r} must be auto, cpu, cuda or cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device={spec!r}: torch sees no CUDA device on this machine")
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise ValueError(f"--device={spec!r}: this machine has {torch.cuda.device_count()} CUDA devices "
                             f"(cuda:0 to cuda:{torch.cuda.device_count() - 1})")
        device = torch.device("cuda", index)
    return device


def device_memory_bytes(device: torch.device) -> int:
    """What one server on `device` can hold: the GPU's memory, or the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return physical_memory_bytes()
