"""The bytes a stage server holds for its job, by kind, current and peak.

Every place that allocates or frees a tensor the job keeps tells the ledger
(protos/memory.py); the coordinator's memory model (coordinator/memory_model.py) walks
the same program with a ledger of its own and predicts the same figures, and the tests
hold one against the other. The resident-set high-water mark is the operating system's
view of the same process, for comparison with peers that have no ledger (bench/).
"""

from __future__ import annotations

from protos.memory import KINDS, MemoryLedger

__all__ = ["KINDS", "MemoryLedger", "nbytes", "reset_rss_peak", "rss_peak_bytes"]


def nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


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
