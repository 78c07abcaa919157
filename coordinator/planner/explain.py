"""Why a ranked plan is where it is: where its step's time goes, what it holds, and how
it fared against its variants, the same layout with another ZeRO stage, recompute mode
or sequence parallelism, as the search weighed them (search.py records an Outcome for
every candidate it looked at).

Worked example (docs/planning.md, 4 servers of 572.2 MiB, an 8-layer d_model 256 GPT):
the dp2·tp1·pp2 1f1b m=8 plan keeps ZeRO stage 1, and its explanation says why:

    zero=1, against: zero0 does not fit: needs 5.9 MiB more than a server's 572.2 MiB;
    zero2 +0.00% step, +6.2 MiB peak; zero3 does not fit: needs 5.9 MiB more than ...

Stage 0 and stage 3 do not fit; stage 2 is as fast and holds more. Every such claim is
recomputed in tests/test_planner.py (test_the_explanation_says_why_each_variant_lost).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from interleaf.coordinator.admission import RUNTIME_RESERVE_BYTES, amount_text
from interleaf.coordinator.partition import partition

from .candidates import RECOMPUTE_ORDER, Layout

GIB = 2**30


@dataclass(frozen=True)
class Outcome:
    """What the search made of one candidate layout."""

    kind: str
    """"simulated"; "refused" (the memory model: it does not fit); "dominated" (the
    same layout with less recompute fitted); "bounded" (its
    compute alone could not beat the top); "unweighed" (the search's time budget ran out)."""
    step_s: float = 0.0
    needed_bytes: int = 0
    """Simulated: its peak; refused: what admission would need (peak and reserve)."""


VARIANTS = (("zero", "zero", lambda layout: f"zero{layout.zero}"),
            ("recompute", "recompute", lambda layout: layout.recompute),
            ("sequence_parallel", "sequence parallelism", lambda layout: "sp" if layout.sequence_parallel else "no sp"))
"""The settings a plan is compared on with the layouts that differ from it in that one
setting: (field, what the line calls it, how an alternative is named)."""


def variant_lines(layout: Layout, step_s: float, peak_bytes: int, memory_bytes: int,
                  rivals: dict[Layout, Outcome]) -> list[str]:
    """One line per setting in which `rivals` hold an alternative to `layout` that tells
    something: one simulated (its step and peak against this plan's), one memory refused
    (by how much), or one left unweighed. Not listed: alternatives with more recompute
    where less fitted (slower, and their savings not needed) and those whose compute
    alone could not beat the top plans (search.TOLERANCE: by the cost model, at most 1%
    faster than the slowest of them)."""
    lines = []
    for name, called, label in VARIANTS:
        others = sorted((rival for rival, outcome in rivals.items()
                         if outcome.kind in TOLD and _differs_only_in(rival, layout, name)),
                        key=lambda rival: _rank(name, getattr(rival, name)))
        if not others:
            continue
        parts = [f"{label(rival)} {_against(rivals[rival], step_s, peak_bytes, memory_bytes)}" for rival in others]
        chosen = getattr(layout, name)
        value = "on" if chosen is True else "off" if chosen is False else chosen
        lines.append(f"{called}={value}, against: " + "; ".join(parts))
    return lines


TOLD = ("simulated", "refused", "unweighed")


def _rank(name: str, value) -> int:
    """Alternatives in their natural order: ZeRO stages up, recompute none to full."""
    return RECOMPUTE_ORDER.index(value) if name == "recompute" else int(value)


def _differs_only_in(rival: Layout, layout: Layout, name: str) -> bool:
    return rival != layout and dataclasses.replace(rival, **{name: getattr(layout, name)}) == layout


def _against(outcome: Outcome, step_s: float, peak_bytes: int, memory_bytes: int) -> str:
    if outcome.kind == "simulated":
        slower = outcome.step_s / step_s - 1
        return f"{slower:+.{1 if abs(slower) >= 0.01 else 2}%} step, {_size(outcome.needed_bytes - peak_bytes, '+')} peak"
    if outcome.kind == "refused":
        return (f"does not fit: needs {_size(outcome.needed_bytes - memory_bytes)} more than a server's "
                f"{amount_text(memory_bytes)}")
    return "not weighed (the search's time budget ran out)"


def _size(count: int, sign: str = "") -> str:
    """Bytes in GiB, MiB below one GiB, KiB below one MiB (differences of a few MiB may
    decide whether a layout fits)."""
    for unit, name in ((GIB, "GiB"), (2**20, "MiB")):
        if abs(count) >= unit:
            return f"{count / unit:{sign}.{2 if unit == GIB else 1}f} {name}"
    return f"{count / 1024:{sign}.1f} KiB"


def explain(plan, best=None) -> list[str]:
    """Why the plan's step takes what it does: where its time goes, what it holds, and
    (plan.why_variants) how its ZeRO stage, recompute and sequence parallelism fared
    against the alternatives. `plan` is a search.RankedPlan."""
    cfg, costs = plan.config, plan.costs
    p, t = cfg.parallel, cfg.train
    microbatches = f"{p.microbatches} microbatch{'es' if p.microbatches > 1 else ''}"
    idle = (f"in the pipeline's bubble ({microbatches} over pp={p.pp}, {p.schedule}) and waiting for messages and "
            f"collectives" if p.pp > 1 else f"waiting for collectives ({microbatches}, no pipeline)")
    lines = [f"lower bound {plan.lower_bound_s:.4f} s (the busiest rank's compute"
             + (", with the pipeline's fill and drain" if p.pp > 1 else "")
             + f"); ranks idle {plan.bubble:.1%} of the step, {idle}"]
    if p.tp > 1:
        share = costs.tp_collective_s / max(costs.forward_s)
        calls = "reduce-scatters and all-gathers" if p.sequence_parallel else "all-reduces"
        lines.append(f"tp={p.tp}: the tensor group's {calls} are {share:.0%} of the largest chunk's forward")
    if p.dp > 1:
        what = "reduce-scatter" if p.zero >= 1 else "all-reduce"
        lines.append(f"dp={p.dp}: each chunk's gradient {what} {costs.reduce_s * 1e3:.1f} ms"
                     + (f", each parameter gather {costs.gather_s * 1e3:.1f} ms" if p.zero == 3 else ""))
    compared = {line.split("=", 1)[0] for line in plan.why_variants}
    if t.recompute != "none" and "recompute" not in compared:
        lines.append(f"recompute={t.recompute} reruns forward work in the backward, to fit or to save memory")
    lines += plan.why_variants
    chunks = partition(cfg.model.n_layers, p.pp, p.vpp, p.schedule, p.layers)
    sizes = sorted({len(c.layers) for c in chunks})
    if len(sizes) > 1:
        lines.append(f"uneven split: chunks hold {sizes[0]}-{sizes[-1]} layers")
    lines.append(f"peak memory {amount_text(max(plan.peak_bytes))} (+{RUNTIME_RESERVE_BYTES / GIB:.1f} GiB "
                 f"process reserve) on pipeline rank {plan.peak_bytes.index(max(plan.peak_bytes))}")
    if best is not None and best is not plan:
        lines.append(f"{plan.step_s / best.step_s - 1:+.1%} against the best")
    return lines
