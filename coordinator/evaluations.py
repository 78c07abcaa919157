"""Which steps of a RunSteps block are followed by an evaluation, and the EvalEvent the
driver publishes from the ranks' reports of it (docs/validation.md).

The points are `eval_points` (coordinator/config/eval.py), a function of the step alone,
so a resumed or recovered job evaluates where an uninterrupted one does.

Worked example, eval.every=3, train.steps=8, blocks of 8 steps: the block from step 0
asks for evaluations after steps 2, 5 and 7 (0-based: 3, 6 and 8 steps completed); a
job resumed at step 4 asks, in its block [4, 8), after steps 5 and 7.
"""

from __future__ import annotations

import math

from interleaf.coordinator.config import JobConfig
from interleaf.coordinator.config.eval import eval_points
from interleaf.protos import interleaf_pb2 as pb


def evaluated_in_block(config: JobConfig, first: int, count: int) -> list[int]:
    """The steps of [first, first+count) (0-based) after which the job is scored."""
    return [done - 1 for done in eval_points(config.eval.every, config.train.steps) if first < done <= first + count]


def eval_event(config: JobConfig, reports: list[pb.StepReport]) -> pb.EvalEvent:
    """The evaluation after the reports' step: the mean over every scored token, each
    replica's mean weighted by its tokens (replicas score equal shares, so equal weights)."""
    scored = [r for r in reports if r.eval_tokens]
    tokens = sum(r.eval_tokens for r in scored)
    loss = math.fsum(r.eval_loss * r.eval_tokens for r in scored) / tokens if tokens else float("nan")
    return pb.EvalEvent(step=reports[0].step + 1, loss=loss, perplexity=perplexity(loss),
                        samples=config.eval.samples, tokens=tokens,
                        seconds=max((r.eval_seconds for r in reports), default=0.0))


def perplexity(loss: float) -> float:
    """exp(loss), infinite past what a float holds."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
