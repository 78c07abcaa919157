"""The memory model's prediction (memory_model.py) as the table `interleaf schedule`
prints: one line per pipeline rank, MiB by kind."""

from __future__ import annotations

from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.memory_model import with_temporaries


def memory_table(config: JobConfig, predictions: list[dict[str, int]]) -> str:
    """The prediction per pipeline rank as a table (its dp and tp replicas hold the same)."""
    p, t = config.parallel, config.train
    columns = [("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"),
               ("optimizer", "optimizer_bytes"), ("params peak", "parameters_peak_bytes"),
               ("grads peak", "gradients_peak_bytes"), ("activations peak", "activations_peak_bytes"),
               ("comm peak", "communication_peak_bytes"), ("peak", "peak_bytes"),
               ("loss temps", "loss_temporaries_bytes")]
    header = ["pipeline rank"] + [name for name, _ in columns] + ["admitted"]
    rows = [[str(rank)] + [_mib(pred[key]) for _, key in columns] + [_mib(with_temporaries(pred))]
            for rank, pred in enumerate(predictions)]
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = [f"predicted memory per rank, MiB (ZeRO stage {p.zero}, {t.precision}, "
             f"recompute {t.recompute}; state at the end of a step, peaks during it; the loss's "
             f"forward temporaries on the peak: what admission adds its reserve to):"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows]]
    return "\n".join(lines)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f}"
