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
from interleaf.coordinator.config.eval import eval_microbatches, eval_points
from interleaf.protos import interleaf_pb2 as pb


def evaluated_in_block(config: JobConfig, first: int, count: int) -> list[int]:
    """The steps of [first, first+count) (0-based) after which the job is scored."""
    return [done - 1 for done in eval_points(config.eval.every, config.train.steps) if first < done <= first + count]


def eval_event(config: JobConfig, reports: list[pb.StepReport]) -> pb.EvalEvent:
    """The evaluation after the reports' step, from every rank's evaluation report: the
    mean over every scored token, each replica's mean weighted by its tokens (replicas
    score equal shares, so equal weights)."""
    parts = [r.evaluation for r in reports]
    scored = [e for e in parts if e.tokens]
    tokens = sum(e.tokens for e in scored)
    loss = math.fsum(e.loss * e.tokens for e in scored) / tokens if tokens else float("nan")
    return pb.EvalEvent(step=reports[0].step + 1, loss=loss, perplexity=perplexity(loss),
                        samples=config.eval.samples, tokens=tokens,
                        seconds=max((e.seconds for e in parts), default=0.0))


def eval_allowance(config: JobConfig, step_s: float, slowest_eval_s: float) -> float:
    """How long the driver waits on an evaluation (no report from it) before declaring
    the job stuck: the progress deadline (recovery.progress_timeout_s, or ten times a
    step, `step_s`) stretched by the evaluation's microbatches over a step's (an
    evaluation microbatch is a forward only, about a third of a training microbatch's
    work, so this is still thirty times what it should take), or ten times the slowest
    evaluation already seen.

    Worked example: progress_timeout_s=60, steps of 2 s with 4 microbatches,
    eval.samples=4000 at 2 rows a microbatch (2000 microbatches): max(60, 10 * 2 * 2000/4)
    = 10000 s."""
    p, e = config.parallel, config.eval
    ratio = max(1.0, eval_microbatches(e.samples, config.train.global_batch, p.microbatches) / p.microbatches)
    return max(config.recovery.progress_timeout_s, 10 * step_s * ratio, 10 * slowest_eval_s)


def perplexity(loss: float) -> float:
    """exp(loss), infinite past what a float holds."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf
