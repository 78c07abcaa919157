"""The RankMemory figures (interleaf.proto) from a byte ledger's state: shared by the
stage server's ledger and the coordinator's prediction, so both report the same fields
computed the same way."""

from __future__ import annotations

KINDS = ("parameters", "gradients", "optimizer", "activations", "communication")


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
