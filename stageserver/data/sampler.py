"""Which samples a step holds: a function of (seed, step, global_batch) and the data
alone, as Megatron's GPT dataset draws them, so that every layout (dp, tp, pp, vpp,
schedule, microbatches, ZeRO), every resume and recovery, and the single-process
reference train on the same tokens.

Packing. A token file is a stream of documents (each followed by the tokenizer's
end-of-document token, when it has one) cut into samples of seq_len+1 tokens that
overlap by one: sample k is tokens [k*seq_len, k*seq_len + seq_len + 1), its inputs the
first seq_len of them and its targets the last. A file of N tokens holds
P = (N-1) // seq_len samples; the few tokens after the last sample are not trained on.

Order. A file's samples are walked in epochs without replacement, each epoch a
permutation of all P seeded by (seed, file, epoch): the file's n-th sample drawn is
sample perm_e[n mod P] of epoch e = n // P. A blend (blend.py) deals each global sample
to one of its files, each of which walks its own epochs so; one file is a blend of one.

Steps. Step s takes the global_batch samples after those of the steps before it:
global samples [first, first + global_batch) with first = start_samples +
(s - start_step) * global_batch, where (start_step, start_samples) is the job's data
position: (0, 0) for a new job, a checkpoint's step and consumed samples for a resumed
one. Only then is the step split: microbatch j of m holds its rows
[j*G/m, (j+1)*G/m), and data-parallel replica d of dp the d-th contiguous slice of those.

Worked example, seq_len=4, a file of 13 tokens, global_batch=2, seed 0: samples 0, 1,
2 are tokens [0, 5), [4, 9), [8, 13); epoch 0's permutation is [2, 0, 1] and epoch 1's
[1, 2, 0], so step 0 holds samples 2 and 0, and step 1 samples 1 (the last of epoch 0)
and 1 (the first of epoch 1). At microbatches=2, microbatch 1 of step 0 is sample 0;
at dp=2 with one microbatch, replica 1 holds it.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from interleaf.common.data.blend import BLOCK, apportion, block_order
from interleaf.stageserver.data.tokenfile import TokenFile


class PackedFile:
    """One token file as samples of seq_len+1 tokens, walked in seeded epochs."""

    def __init__(self, data: TokenFile, seq_len: int, seed: int, index: int = 0):
        """`index`: the file's place in a blend, so that its files shuffle apart."""
        self.samples = (len(data) - 1) // seq_len  # per epoch
        if self.samples < 1:
            raise ValueError(
                f"data.source={str(data.path)!r} has {len(data)} tokens, fewer than "
                f"model.seq_len+1={seq_len + 1} (one sample's inputs and targets)"
            )
        self.data = data
        self.seq_len = seq_len
        self.seed = (seed, index)
        self._span = np.arange(seq_len + 1)
        self._epochs: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch `epoch`'s order of the samples (P int64: 8 bytes per sample)."""
        with self._lock:
            order = self._epochs.get(epoch)
            if order is None:
                order = np.random.default_rng([*self.seed, epoch]).permutation(self.samples)
                # Two epochs kept: a step that straddles a boundary, and a recompute's
                # rerun of an earlier microbatch, read both ends without recomputing.
                if len(self._epochs) == 2:
                    del self._epochs[next(iter(self._epochs))]
                self._epochs[epoch] = order
            return order

    def windows(self, drawn: np.ndarray) -> np.ndarray:
        """The samples this file drew `drawn`-th (0: its first), int64 [len, seq_len+1]."""
        epochs, within = np.divmod(drawn, self.samples)
        starts = np.empty_like(drawn)
        for epoch in np.unique(epochs):
            here = epochs == epoch
            starts[here] = self.permutation(int(epoch))[within[here]] * self.seq_len
        return self.data.tokens[starts[:, None] + self._span].astype(np.int64)


class Sampler:
    """The samples of every step of one job, and each microbatch's and replica's cut of
    them (the module's docstring)."""

    def __init__(self, source, seed: int, seq_len: int, global_batch: int, microbatches: int = 1,
                 start_step: int = 0, start_samples: int = 0):
        """`source`: data.source opened (corpus.Source). (`start_step`, `start_samples`): the
        data position, step start_step taking the samples from start_samples on."""
        if global_batch % microbatches:
            raise ValueError(f"train.global_batch={global_batch} does not split into {microbatches} microbatches")
        self.names = [f.path.name for f in source.files]
        self.files = [PackedFile(f, seq_len, seed, i) for i, f in enumerate(source.files)]
        self.global_batch = global_batch
        self.rows = global_batch // microbatches
        self.start_step, self.start_samples = start_step, start_samples
        self.per_block = np.array(apportion(source.weights), dtype=np.int64)
        file_at, rank_at = block_order(self.per_block.tolist())
        self._file_at = np.array(file_at, dtype=np.int64)  # per position of a block
        self._rank_at = np.array(rank_at, dtype=np.int64)
        self._positions = [np.flatnonzero(self._file_at == i) for i in range(len(self.files))]

    def first_sample(self, step: int) -> int:
        """The global number of step `step`'s first sample: the samples consumed before it."""
        if step < self.start_step:
            raise ValueError(f"step {step} comes before this job's data position (step {self.start_step})")
        return self.start_samples + (step - self.start_step) * self.global_batch

    def windows(self, first: int, count: int) -> torch.Tensor:
        """Global samples [first, first+count), int64 [count, seq_len+1]."""
        n = np.arange(first, first + count, dtype=np.int64)
        block, position = np.divmod(n, BLOCK)
        which = self._file_at[position]
        # Every block deals each file per_block samples: this file drew that many in
        # each earlier block, and rank_at before this sample in its own.
        drawn = block * self.per_block[which] + self._rank_at[position]
        out = np.empty((count, self.files[0].seq_len + 1), dtype=np.int64)
        for i in np.unique(which):
            here = which == i
            out[here] = self.files[i].windows(drawn[here])
        return torch.from_numpy(out)

    def microbatch(self, step: int, microbatch: int, replica: int = 0, replicas: int = 1):
        """(inputs, targets), int64 [rows/replicas, seq_len], for one replica's slice:
        views of one [rows/replicas, seq_len+1] window (coordinator/activation_bytes.py)."""
        if self.rows % replicas:
            raise ValueError(f"{self.rows} rows per microbatch do not split over {replicas} replicas")
        per = self.rows // replicas
        windows = self.windows(self.first_sample(step) + microbatch * self.rows + replica * per, per)
        return windows[:, :-1], windows[:, 1:]

    def _drawn(self, file: int, n: int) -> int:
        """How many of global samples [0, n) file `file` drew."""
        block, position = divmod(n, BLOCK)
        return block * int(self.per_block[file]) + int(np.searchsorted(self._positions[file], position))

    def epochs_begun(self, step: int) -> list[tuple[str, int, int]]:
        """(file name, epoch, samples per epoch) for each epoch after the first that
        begins among step `step`'s samples."""
        first = self.first_sample(step)
        begun = []
        for i, packed in enumerate(self.files):
            low, high = self._drawn(i, first), self._drawn(i, first + self.global_batch)
            for epoch in range(max(1, -(-low // packed.samples)), -(-high // packed.samples)):
                begun.append((self.names[i], epoch, packed.samples))
        return begun
