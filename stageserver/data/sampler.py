"""Which samples a step holds: a function of (seed, step) alone, so every layout, every
restart and the single-process reference see the same tokens.

A step's global batch is a sequence of windows of seq_len+1 tokens whose offsets are
the successive draws of a generator seeded by (seed, step). Microbatch j of a step cut
into microbatches of `rows` windows holds draws [j*rows, (j+1)*rows); data-parallel
replica d of dp takes the d-th contiguous slice of those. Row r of the step is the
same window however the step is cut, so a job that goes on with fewer replicas and
proportionally more microbatches (parallel.elastic) trains on the same samples.

Worked example, global_batch=8: with 4 microbatches of 2 rows, microbatch 2 holds
draws 4 and 5, and under dp=2 replica 1 trains on draw 5; with dp=1 and 8 microbatches
of 1 row, draw 5 is microbatch 5.
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
        rng = np.random.default_rng([self.seed, step])
        # A window is seq_len+1 tokens; the last one may end at the file's last token.
        # The generator draws in sequence, so the step's first (microbatch+1)*rows
        # draws are the same whatever the cut (tests/test_elastic.py checks it).
        drawn = rng.integers(0, len(self.data) - self.seq_len, size=(microbatch + 1) * self.rows)
        return drawn[microbatch * self.rows:]

    def microbatch(self, step: int, microbatch: int, replica: int = 0, replicas: int = 1):
        """(inputs, targets), int64 [rows/replicas, seq_len], for one replica's slice."""
        if self.rows % replicas:
            raise ValueError(f"{self.rows} rows per microbatch do not split over {replicas} replicas")
        per = self.rows // replicas
        offsets = self.offsets(step, microbatch)[replica * per : (replica + 1) * per]
        windows = np.stack([self.data.tokens[o : o + self.seq_len + 1] for o in offsets])
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
