"""[eval]: held-out validation, scored through the job's own layout (docs/validation.md).

Worked example, `eval.every=3`, `train.steps=8`: the model is scored after steps 3, 6
and 8 have completed (`eval_points`), each time on the same `eval.samples` samples:
the first ones packed from `eval.source`, or, with no source, from the last
`eval.fraction` of `data.source`'s documents, which training then never reads
(stageserver/data/holdout.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from interleaf.coordinator.config.rules import ConfigError, _bounded

DEFAULT_FRACTION = 0.01
"""Megatron-LM's usual split (`--split 969,30,1`) holds out about 3% for validation;
torchtitan's validation reads a separate set. 1% of a corpus is plenty of documents to
draw a few hundred samples from and costs training almost nothing."""


@dataclass(frozen=True)
class EvalConfig:
    """[eval]: held-out validation, scored forward-only through the job's own layout
    (docs/validation.md)."""

    every: int = 0
    """Score the held-out samples after every this many steps, and after the last step
    (0, the default: no evaluation, and no document held out)."""
    samples: int = 64
    """How many held-out samples (of model.seq_len+1 tokens) each evaluation scores: the
    same fixed set every time, so evaluations are comparable. They run as microbatches
    of the training microbatch's shape (train.global_batch/parallel.microbatches rows,
    split over the data-parallel replicas)."""
    source: str = ""
    """A token file (written by `interleaf data prepare`) to score, readable on every
    stage server; training then reads all of data.source. "" holds out `fraction` of
    data.source's documents instead. Refused at submission when its sidecar records a
    larger vocabulary than the model's, or another tokenizer than data.source's."""
    fraction: float = DEFAULT_FRACTION
    """With no `source`: the fraction of each data.source file's tokens held out, cut at
    the first document boundary at or after that point (whole documents, the file's
    last ones), never trained on. Recorded in checkpoints: a resume must keep it."""

    def __post_init__(self):
        _bounded("eval", self)
        if self.every < 0:
            raise ConfigError(f"eval.every={self.every} must be 0 (no evaluation) or more")
        if self.samples < 1:
            raise ConfigError(f"eval.samples={self.samples} must be at least 1")
        if not 0.0 < self.fraction < 1.0:
            raise ConfigError(f"eval.fraction={self.fraction} must be between 0 and 1 (exclusive): the "
                              f"share of data.source's documents held out")
        if self.source and not self.source.strip():
            raise ConfigError(f"eval.source={self.source!r} must be a token file path, or empty to hold out "
                              f"eval.fraction of data.source")
        if "," in self.source:
            raise ConfigError(f"eval.source={self.source!r} must name one token file, not a blend")

    @property
    def enabled(self) -> bool:
        return self.every > 0

    @property
    def held_out(self) -> float:
        """The fraction of data.source training never reads: `fraction` when evaluating
        on held-out documents, else 0 (training reads all of it, as with eval off)."""
        return self.fraction if self.enabled and not self.source else 0.0


def eval_points(every: int, steps: int) -> list[int]:
    """The steps completed after which a job is scored: every `every`-th, and the last.

    Worked example: eval_points(3, 8) == [3, 6, 8]; eval_points(4, 8) == [4, 8];
    eval_points(0, 8) == [] (off). Shared by the driver and `interleaf reference`, so
    both score at the same points, whatever checkpoints and recoveries happen between.
    """
    if every <= 0:
        return []
    return sorted({s for s in range(every, steps + 1, every)} | {steps})


def eval_microbatches(samples: int, global_batch: int, microbatches: int) -> int:
    """Microbatches one evaluation runs: `samples` in microbatches of the training
    microbatch's rows (eval.samples must split so; job.py says so when not)."""
    return samples // (global_batch // microbatches)
