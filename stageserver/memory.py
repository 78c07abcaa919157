"""The bytes a stage server holds for its job, by kind, current and peak.

Every place that allocates or frees a tensor the job keeps tells the ledger; the
coordinator's memory model (coordinator/memory_model.py) walks the same program and
predicts the same figures, and the tests hold one against the other. The resident-set
high-water mark is the operating system's view of the same process, for comparison
with peers that have no ledger (bench/).
"""

from __future__ import annotations

import threading

from protos.memory import KINDS


class MemoryLedger:
    def __init__(self):
        self._lock = threading.Lock()  # async collectives finish on other threads
        self.current = dict.fromkeys(KINDS, 0)
        self.peak = dict.fromkeys(KINDS, 0)
        self.total_peak = 0

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.current[kind] += nbytes
            self.peak[kind] = max(self.peak[kind], self.current[kind])
            self.total_peak = max(self.total_peak, sum(self.current.values()))

    def free(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.current[kind] -= nbytes
            if self.current[kind] < 0:
                raise RuntimeError(f"memory ledger: {kind} went negative ({self.current[kind]} bytes)")

    def reset_peaks(self) -> None:
        """Peaks from now on start at what is held now (called at each step's start)."""
        with self._lock:
            self.peak = dict(self.current)
            self.total_peak = sum(self.current.values())


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
