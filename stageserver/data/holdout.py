"""Held-out validation data: which documents training never reads, and the fixed set of
samples every evaluation scores (coordinator/config/eval.py).

The split, per file of data.source: the last `fraction` of its tokens, cut at the first
document start at or after token floor((1 - fraction) * N), so that whole documents
(the file's last ones, as Megatron's `--split` takes contiguous document ranges) are
held out and train and validation never share one. A document starts after the file's
end-of-document id, or where its sidecar's `document_starts` says (the builtin corpus,
tokenized by bytes, has no such id); a file with neither is refused (use eval.source).
Training then samples only tokens [0, cut) of each file (`TokenSpan`, handed to the
Sampler in place of the file: its epochs are those of the shorter file); with no split
(eval off, or eval.source, in a job that held nothing out) it reads the files whole,
exactly as before (`training_data`).

The set: the first `samples` windows of seq_len+1 tokens packed (overlapping by one, as
sampler.py packs) from the held-out tokens of each file in turn, or from eval.source.
Fixed and unshuffled: every evaluation, layout, resume and the reference score the very
same tokens.

Worked example, a file of 100 tokens whose documents start at 0, 40, 90, 96, fraction
0.1: the cut goes to the first start at or after token 90, so tokens [90, 100) are held
out and training reads [0, 90); at seq_len=4 they pack two windows, [90, 95) and [94, 99).
"""

from __future__ import annotations

import numpy as np
import torch
from interleaf.stageserver.data.tokenfile import TokenFile

_SCAN = 1 << 20  # tokens read at once while looking for an end-of-document id


class TokenSpan:
    """The first `end` tokens of a token file: what training reads of it under a split."""

    def __init__(self, data: TokenFile, end: int):
        self.path, self.meta, self.sha256, self.vocab_size = data.path, data.meta, data.sha256, data.vocab_size
        self.tokens = data.tokens[:end]

    def __len__(self) -> int:
        return int(self.tokens.size)


class TrainSource:
    """data.source less its held-out tokens: what the Sampler draws from (corpus.Source's
    `files` and `weights`)."""

    def __init__(self, files: list, weights: list[float]):
        self.files, self.weights = files, weights


def document_cut(data: TokenFile, fraction: float) -> int:
    """The token where `data`'s held-out documents begin (module docstring)."""
    target = int(len(data) * (1.0 - fraction))
    starts = data.meta.get("document_starts")
    eos = data.meta.get("eos_id")
    if starts is not None:
        starts = np.asarray(starts, dtype=np.int64)
        later = starts[(starts >= target) & (starts > 0)]
        cut = int(later[0]) if later.size else None
    elif eos is not None:
        cut = _next_document(data.tokens, target, eos)
    else:
        raise ValueError(f"data.source={str(data.path)!r} records no document boundaries (no end-of-document id "
                         f"and no document_starts in its sidecar), so eval.fraction cannot hold out whole "
                         f"documents: prepare it with a tokenizer that has one, or set eval.source")
    if cut is None or cut >= len(data):
        raise ValueError(f"eval.fraction={fraction}: data.source={str(data.path)!r} has no document starting in "
                         f"its last {fraction:.3g} of tokens (its last document is longer): raise eval.fraction "
                         f"or set eval.source")
    return cut


def _next_document(tokens: np.ndarray, target: int, eos: int) -> int | None:
    """The first position at or after `target` (and after 0) that follows an eos token."""
    position = max(target - 1, 0)  # a document starting at `target` follows an eos at target-1
    while position < tokens.size:
        block = np.asarray(tokens[position:position + _SCAN])
        found = np.flatnonzero(block == eos)
        if found.size:
            return position + int(found[0]) + 1
        position += _SCAN
    return None


def split_source(source, fraction: float) -> tuple[TrainSource, list[np.ndarray]]:
    """(what training reads of `source`, each file's held-out tokens)."""
    cuts = [document_cut(f, fraction) for f in source.files]
    train = TrainSource([TokenSpan(f, cut) for f, cut in zip(source.files, cuts)], list(source.weights))
    return train, [f.tokens[cut:] for f, cut in zip(source.files, cuts)]


def training_data(source, held_out: float):
    """What training reads of data.source: all of it, the very `source` (held_out 0:
    evaluation off, or on eval.source, in a job that held nothing out), or each file
    less its last `held_out` of documents. The job's split, or a resumed checkpoint's
    (coordinator/data_split.py), whether or not this job evaluates."""
    return split_source(source, held_out)[0] if held_out else source


class EvalSet:
    """The fixed samples every evaluation scores, [samples, seq_len+1] (module docstring).

    Never held whole: the set can be far larger than a step (eval.samples up to 2^20 of
    seq_len+1 tokens), so it keeps views of the token files (memory-mapped, in their own
    dtype) and cuts each microbatch out as int64 when it is scored, as the Sampler does."""

    def __init__(self, held_out: list[np.ndarray], seq_len: int, samples: int, where: str):
        self.parts = []  # (first sample, samples, tokens they span) per file scored
        found = 0
        for tokens in held_out:
            count = min((tokens.size - 1) // seq_len, samples - found)
            if count > 0:
                self.parts.append((found, count, tokens[:count * seq_len + 1]))
                found += count
        if found < samples:
            raise ValueError(f"eval.samples={samples} needs {samples} windows of model.seq_len+1={seq_len + 1} "
                             f"tokens, and {where} holds only {found}: lower eval.samples"
                             f"{' or raise eval.fraction' if 'held-out' in where else ''}")
        self.samples, self.seq_len = samples, seq_len
        self._span = np.arange(seq_len + 1)

    def windows(self, first: int = 0, count: int | None = None) -> torch.Tensor:
        """Samples [first, first+count) of the set (all from `first` by default), int64."""
        count = self.samples - first if count is None else count
        out = np.empty((count, self.seq_len + 1), dtype=np.int64)
        for start, n, tokens in self.parts:
            low, high = max(first, start), min(first + count, start + n)
            if low < high:
                offsets = (np.arange(low, high, dtype=np.int64) - start) * self.seq_len
                out[low - first:high - first] = tokens[offsets[:, None] + self._span]
        return torch.from_numpy(out)

    def microbatch(self, index: int, rows: int, replica: int = 0, replicas: int = 1):
        """(inputs, targets) of evaluation microbatch `index` of `rows` samples, this
        replica's contiguous slice of it (as sampler.py cuts a training microbatch)."""
        per = rows // replicas
        windows = self.windows(index * rows + replica * per, per)
        return windows[:, :-1], windows[:, 1:]

    def largest(self) -> int:
        """The largest token id the set scores, read block by block."""
        return max(int(np.max(tokens[i:i + _SCAN])) for _, _, tokens in self.parts
                   for i in range(0, tokens.size, _SCAN))


def open_eval_set(source, eval_source: str, held_out: float, seq_len: int, samples: int) -> EvalSet:
    """The evaluation set: the first samples of eval.source, or of `source`'s held-out
    documents (the last `held_out` of each file's)."""
    if eval_source:
        try:
            tokens = TokenFile(eval_source, field="eval.source").tokens
        except OSError as err:  # FileNotFoundError names the field; ValueError passes as it is
            raise ValueError(str(err)) from None
        return EvalSet([tokens], seq_len, samples, f"eval.source={eval_source!r}")
    held = split_source(source, held_out)[1]
    return EvalSet(held, seq_len, samples, f"the held-out {held_out:.3g} of data.source")
