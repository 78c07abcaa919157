"""parallel.elastic: the smaller layouts a job that lost servers may go on with, pure.

A layout here keeps tp, pp, vpp, the schedule, the ZeRO stage and the global batch, and
trades data-parallel replicas for microbatches: dp' replicas of dp·m/dp' microbatches
each. A replica's microbatch keeps global_batch/(dp·m) rows (and so its activation
memory), and a step's samples depend on no layout knob (stageserver/data/sampler.py), so
every step sees the same samples and its loss is the uninterrupted run's (up to
summation order).

Worked example: dp=4, m=4, pp=2, interleaved-1f1b, global_batch=16. dp·m=16, so dp'=3
is out (16 microbatches do not split over 3 replicas); dp'=2 runs 8 microbatches and
dp'=1 runs 16, both multiples of pp as interleaved-1f1b needs.
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
