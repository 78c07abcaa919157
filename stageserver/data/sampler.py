"""Which samples a step holds: a function of (seed, step) and the job's submitted cut
alone, so every layout, every restart and the single-process reference see the same
tokens.

A step's global batch is split by the submitted job's microbatch count m into m blocks
of `cut_rows` windows (seq_len+1 tokens each); block b's offsets are drawn from a
generator seeded by (seed, step, b). Row r of the step is row r % cut_rows of block
r // cut_rows. Microbatch j of a job running `rows` windows per microbatch holds rows
[j*rows, (j+1)*rows), and data-parallel replica d of dp takes the d-th contiguous slice
of those. When the job runs its submitted cut (rows == cut_rows) microbatch j is block
j. A job that goes on with fewer replicas and proportionally more microbatches
(parallel.elastic) keeps cut_rows, so it trains on the same rows.

Worked example, global_batch=8 submitted with 4 microbatches (cut_rows=2): rows 4 and
5 are block 2. Under dp=2 replica 1 of microbatch 2 trains on row 5; after shrinking
to dp=1 with 8 microbatches of 1 row, row 5 is microbatch 5.
"""

from __future__ import annotations

import numpy as np
import torch

from interleaf.stageserver.data.tokenfile import TokenFile


class Sampler:
    def __init__(self, data: TokenFile, seed: int, seq_len: int, rows_per_microbatch: int,
                 cut_rows: int | None = None):
        """`cut_rows`: rows per microbatch of the job as submitted (default: this cut's)."""
        if len(data) < seq_len + 1:
            raise ValueError(
                f"data.source={str(data.path)!r} has {len(data)} tokens, fewer than "
                f"model.seq_len+1={seq_len + 1} (one sample's inputs and targets)"
            )
        self.data = data
        self.seed = seed
        self.seq_len = seq_len
        self.rows = rows_per_microbatch
        self.cut_rows = cut_rows or rows_per_microbatch
        self._blocks: tuple[int, dict[int, np.ndarray]] = (-1, {})  # the last step's blocks drawn

    def offsets(self, step: int, microbatch: int) -> np.ndarray:
        """The offsets of the windows of one microbatch of a step."""
        first, end = microbatch * self.rows, (microbatch + 1) * self.rows
        blocks = range(first // self.cut_rows, (end - 1) // self.cut_rows + 1)
        rows = np.concatenate([self._block(step, b) for b in blocks])
        start = first - blocks[0] * self.cut_rows
        return rows[start:start + self.rows]

    def _block(self, step: int, block: int) -> np.ndarray:
        drawn_step, drawn = self._blocks  # one read: another thread may replace it
        if drawn_step != step:
            drawn = {}
            self._blocks = (step, drawn)
        if block not in drawn:
            rng = np.random.default_rng([self.seed, step, block])
            # A window is seq_len+1 tokens; the last one may end at the file's last token.
            drawn[block] = rng.integers(0, len(self.data) - self.seq_len, size=self.cut_rows)
        return drawn[block]

    def microbatch(self, step: int, microbatch: int, replica: int = 0, replicas: int = 1):
        """(inputs, targets), int64 [rows/replicas, seq_len], for one replica's slice."""
        if self.rows % replicas:
            raise ValueError(f"{self.rows} rows per microbatch do not split over {replicas} replicas")
        per = self.rows // replicas
        offsets = self.offsets(step, microbatch)[replica * per : (replica + 1) * per]
        windows = np.stack([self.data.tokens[o : o + self.seq_len + 1] for o in offsets])
        windows = torch.from_numpy(windows.astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
