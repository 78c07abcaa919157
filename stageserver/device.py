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


CPU_FLOPS_PER_THREAD = 1e11
"""The CPU default of --peak-flops, per torch thread: 100 GFLOP/s, one AVX2 core's fp32
peak (two FMA units of 8 lanes, 32 FLOPs a cycle) at about 3 GHz."""

GPU_PEAK_FLOPS = (("H100 PCIe", 756e12), ("H100", 989.4e12), ("H200", 989.4e12), ("A100", 312e12))
"""Datasheet dense bf16 tensor-core peaks, matched against the device's name in order."""


def default_peak_flops(device: torch.device) -> float:
    """The peak FLOP/s of `device` when --peak-flops does not say: on a CPU
    CPU_FLOPS_PER_THREAD per torch thread; on a GPU its datasheet bf16 peak when listed
    in GPU_PEAK_FLOPS, else 0 (unknown: no utilization is reported for its jobs)."""
    if device.type == "cpu":
        return CPU_FLOPS_PER_THREAD * torch.get_num_threads()
    name = torch.cuda.get_device_name(device)
    return next((flops for model, flops in GPU_PEAK_FLOPS if model in name), 0.0)
