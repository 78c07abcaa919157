"""The byte ledger and its RankMemory figures (interleaf.proto): the stage server keeps
one of the tensors it holds, the coordinator's memory model one of the tensors it
predicts, so both count and report the same way."""

from __future__ import annotations

KINDS = ("parameters", "gradients", "optimizer", "activations", "communication")


class MemoryLedger:
    """Bytes held by kind, now and at their peaks since the last reset_peaks()."""

    def __init__(self):
        self.current = dict.fromkeys(KINDS, 0)
        self.peak = dict.fromkeys(KINDS, 0)
        self.total_peak = 0

    def add(self, kind: str, nbytes: int) -> None:
        self.current[kind] += nbytes
        self.peak[kind] = max(self.peak[kind], self.current[kind])
        self.total_peak = max(self.total_peak, sum(self.current.values()))

    def free(self, kind: str, nbytes: int) -> None:
        self.current[kind] -= nbytes
        if self.current[kind] < 0:
            raise RuntimeError(f"memory ledger: {kind} went negative ({self.current[kind]} bytes)")

    def reset_peaks(self) -> None:
        """Peaks from now on start at what is held now (called at each step's start)."""
        self.peak = dict(self.current)
        self.total_peak = sum(self.current.values())

    def report(self) -> dict[str, int]:
        return memory_report(self.current, self.peak, self.total_peak)


def memory_report(current: dict[str, int], peak: dict[str, int], total_peak: int) -> dict[str, int]:
    """State held now (at a step's end) for the kinds that persist; peaks for all."""
    return {
        "parameters_bytes": current["parameters"],
        "gradients_bytes": current["gradients"],
        "optimizer_bytes": current["optimizer"],
        "parameters_peak_bytes": peak["parameters"],
        "gradients_peak_bytes": peak["gradients"],
        "activations_peak_bytes": peak["activations"],
        "communication_peak_bytes": peak["communication"],
        "peak_bytes": total_peak,
    }
