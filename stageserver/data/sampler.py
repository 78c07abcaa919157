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
        self._drawn = (-1, np.empty(0, dtype=np.int64))  # the last step's draws so far

    def offsets(self, step: int, microbatch: int) -> np.ndarray:
        """The offsets of the windows of one microbatch of a step."""
        needed = (microbatch + 1) * self.rows
        drawn_step, drawn = self._drawn  # one read: another thread may replace it
        if drawn_step != step or len(drawn) < needed:
            # One call drawing n values yields the first n of any longer call (the
            # generator draws in sequence; tests/test_elastic.py checks it), so the step's
            # draws are made again, at least twice as many, only when a microbatch lies
            # beyond those kept: each step costs O(its rows), not O(microbatches * rows).
            # A window is seq_len+1 tokens; the last one may end at the file's last token.
            size = max(needed, 2 * len(drawn)) if drawn_step == step else needed
            rng = np.random.default_rng([self.seed, step])
            drawn = rng.integers(0, len(self.data) - self.seq_len, size=size)
            self._drawn = (step, drawn)
        return drawn[microbatch * self.rows:needed]

    def microbatch(self, step: int, microbatch: int, replica: int = 0, replicas: int = 1):
        """(inputs, targets), int64 [rows/replicas, seq_len], for one replica's slice."""
        if self.rows % replicas:
            raise ValueError(f"{self.rows} rows per microbatch do not split over {replicas} replicas")
        per = self.rows // replicas
        offsets = self.offsets(step, microbatch)[replica * per : (replica + 1) * per]
        windows = np.stack([self.data.tokens[o : o + self.seq_len + 1] for o in offsets])
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
