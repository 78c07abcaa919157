"""parallel.elastic: the smaller layouts a job that lost servers may go on with, and
when it grows back to its own, pure.

A layout here keeps tp, pp, vpp, the schedule, the ZeRO stage and the global batch, and
trades data-parallel replicas for microbatches: dp' replicas of dp·m/dp' microbatches
each. A replica's microbatch keeps global_batch/(dp·m) rows (and so its activation
memory), and a step's samples depend on no layout knob (stageserver/data/sampler.py), so
every step sees the same samples and its loss is the uninterrupted run's (up to
summation order), shrunk or grown back.

Worked example: dp=4, m=4, pp=2, interleaved-1f1b, global_batch=16. dp·m=16, so dp'=3
is out (16 microbatches do not split over 3 replicas); dp'=2 runs 8 microbatches and
dp'=1 runs 16, both multiples of pp as interleaved-1f1b needs.

Growing back: say that job, with checkpoint.every=3 and train.steps=12, loses a server
during step 4 and no spare is registered. It goes on from the checkpoint of step 3 at
dp'=2 (4 servers of its 8, 3 idle). A replacement registers during step 5. At the step-6
boundary, once that checkpoint is under way, the job asks for 8 servers among its own 4
and the idle 4 (placement and admission as at submit) and claims them at once; it lets
the save finish, tears the dp'=2 attempt down and resumes from step 6 at dp=4, m=4.
Steps 6-11 run at dp=4 and no step runs twice. Had the replacement registered during
step 10, the job would have stayed at dp'=2: the step-12 boundary is its end. Had another
job been waiting for servers at step 6, the replacement would have been its: a running
job grows only when none waits (coordinator/registry.py).
"""

from __future__ import annotations

import dataclasses

from interleaf.coordinator.config import ConfigError, JobConfig


def smaller_layouts(config: JobConfig) -> list[JobConfig]:
    """The configs the job may go on with, largest dp' first: each dp' < dp that divides
    dp·microbatches and whose config passes every rule (e.g. interleaved-1f1b's
    microbatches being a multiple of pp, and the bounds of common/limits.py on
    microbatches and pipeline slots, which dp'=1 may break). An elastic config has at
    least one: coordinator/config.py refuses it at submit otherwise."""
    p = config.parallel
    samples = p.dp * p.microbatches  # microbatch slices per step, all replicas together
    found = []
    for dp in range(p.dp - 1, 0, -1):
        if samples % dp:
            continue
        try:
            found.append(_with_layout(config, dp, samples // dp))
        except ConfigError:
            continue  # a rule of the schedule this dp' breaks
    return found


def _with_layout(config: JobConfig, dp: int, microbatches: int) -> JobConfig:
    # A smaller job need not be elastic itself (dp'=1 cannot be): it is the same job,
    # and a later recovery starts again from the submitted layout.
    parallel = dataclasses.replace(config.parallel, dp=dp, microbatches=microbatches, elastic=False)
    return dataclasses.replace(config, parallel=parallel)


def describe_change(submitted: JobConfig, running: JobConfig, idle: int) -> str:
    """Why the job runs under another layout than its own, for its status and events."""
    p, q = submitted.parallel, running.parallel
    return (f"parallel.elastic: dp={q.dp}, microbatches={q.microbatches} on {q.world_size} servers "
            f"(the submitted dp={p.dp}, microbatches={p.microbatches} needs {p.world_size}; the {idle} "
            f"idle could not hold it): the same global batch and samples")


def grows_back(submitted: JobConfig, running: JobConfig, step: int) -> bool:
    """Whether a job running under a smaller layout than its submitted one (it shrank)
    asks for the servers of its own layout after `step` steps. Only at a checkpoint
    boundary: the grown layout resumes from the checkpoint saved there, resharded, so no
    step runs twice and none is lost (a job without checkpoint.every never grows). Never
    at the job's end, where nothing is left to run."""
    c = submitted.checkpoint
    return (running.parallel.dp < submitted.parallel.dp and bool(c.dir) and c.every > 0
            and step % c.every == 0 and 0 < step < submitted.train.steps)


def describe_growth(submitted: JobConfig, running: JobConfig, step: int, added: int) -> str:
    """Why the job changed its layout at `step`, for its status and events."""
    p, q = submitted.parallel, running.parallel
    return (f"parallel.elastic: grew back to the submitted dp={p.dp}, microbatches={p.microbatches} on "
            f"{p.world_size} servers at the checkpoint of step {step} (from dp={q.dp}, microbatches="
            f"{q.microbatches}; {added} more servers were free): the same global batch and samples")
