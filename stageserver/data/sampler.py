"""Which samples a microbatch holds: a function of (seed, step, microbatch) alone, so
every layout, every restart and the single-process reference see the same tokens.

A microbatch is `rows` windows of seq_len+1 tokens at offsets drawn from a generator
seeded by (seed, step, microbatch); data-parallel replica d of dp takes the d-th
contiguous slice of those rows.
"""

from __future__ import annotations

import numpy as np
import torch

from interleaf.stageserver.data.tokenfile import TokenFile


class Sampler:
    def __init__(self, data: TokenFile, seed: int, seq_len: int, rows_per_microbatch: int):
        if len(data) < seq_len + 1:
            raise ValueError(
                f"data.source={str(data.path)!r} has {len(data)} tokens, fewer than "
                f"model.seq_len+1={seq_len + 1} (one sample's inputs and targets)"
            )
        self.data = data
        self.seed = seed
        self.seq_len = seq_len
        self.rows = rows_per_microbatch

    def offsets(self, step: int, microbatch: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, step, microbatch])
        # A window is seq_len+1 tokens; the last one may end at the file's last token.
        return rng.integers(0, len(self.data) - self.seq_len, size=self.rows)

    def microbatch(self, step: int, microbatch: int, replica: int = 0, replicas: int = 1):
        """(inputs, targets), int64 [rows/replicas, seq_len], for one replica's slice."""
        if self.rows % replicas:
            raise ValueError(f"{self.rows} rows per microbatch do not split over {replicas} replicas")
        per = self.rows // replicas
        offsets = self.offsets(step, microbatch)[replica * per : (replica + 1) * per]
        windows = np.stack([self.data.tokens[o : o + self.seq_len + 1] for o in offsets])
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
