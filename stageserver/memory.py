"""The bytes a stage server holds for its job, by kind, current and peak.

Every place that allocates or frees a tensor the job keeps tells the ledger
(common/memory.py); the coordinator's memory model (coordinator/memory_model.py) walks
the same program with a ledger of its own and predicts the same figures, and the tests
hold one against the other. The resident-set high-water mark is the operating system's
view of the same process, for comparison with peers that have no ledger (bench/).
"""

from __future__ import annotations

from interleaf.common.memory import KINDS, MemoryLedger

import torch

__all__ = ["KINDS", "MemoryLedger", "device_peak_bytes", "nbytes", "reset_peaks", "rss_peak_bytes"]


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def reset_peaks(device: torch.device) -> None:
    """Starts the step's high-water marks: the process's resident set, and on a GPU the
    bytes torch's caching allocator has handed out."""
    reset_rss_peak()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def device_peak_bytes(device: torch.device) -> int:
    """torch.cuda.max_memory_allocated since the last reset (0 on a CPU): what a
    PyTorch user reads for a GPU's memory, so peers can be compared the same way."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0


def reset_rss_peak() -> None:
    """Resets the kernel's resident-set high-water mark (VmHWM) of this process
    (proc(5), /proc/pid/clear_refs, value 5)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not Linux, or not allowed: the figure then covers the process's life


def rss_peak_bytes() -> int:
    """VmHWM of this process since the last reset, in bytes (0 where unknown)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
