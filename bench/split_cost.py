"""What splitting a backward costs, read from executed traces.

A zero-bubble schedule runs each backward as two actions, I (the input gradient) and W
(the weight gradient), where the fused schedules run one, B. Both compute the same
gradients; the split can cost more (W reads back what I left, each half walks its own
part of the graph, two dispatches instead of one). Interleaf's traced steps time every
compute action without the wait for its inputs (that is a separate "wait" span), so per
chunk, over every traced step and microbatch,

    ratio = (mean I + mean W of the split run) / mean B of the fused run

with the same chunks (the same layers: zb-h1 against 1f1b, zbv against interleaved
1F1B; a chunk's rank may differ, its work does not). 1 means the split is free.

The two runs are different jobs, a minute or so apart; on a shared machine the load can
change between them, and it moves every action's time alike. So the figure is also given
with each run's backward over that run's own forwards of the chunk (the same work in
both runs, so a measure of the load):

    ratio per forward = ((mean I + mean W) / mean F of the split run) / (mean B / mean F of the fused run)
"""

from __future__ import annotations

import statistics

from interleaf.protos.actions import parse

from measure import table  # sibling in bench/

Spans = dict[int, dict[int, list[tuple[str, str, float]]]]
"""step -> rank -> [(action, kind, seconds)] of that rank's traced step."""

KINDS = {"forward": "F", "backward": "B", "input-grad": "I", "weight-grad": "W"}


def durations(spans: Spans) -> dict[tuple[int, str], list[float]]:
    """(chunk, "F" | "B" | "I" | "W") -> every such action's compute seconds."""
    found: dict[tuple[int, str], list[float]] = {}
    for ranks in spans.values():
        for rank_spans in ranks.values():
            for action, kind, seconds in rank_spans:
                if kind in KINDS:
                    found.setdefault((parse(action).chunk, KINDS[kind]), []).append(seconds)
    return found


def mean_seconds(spans: Spans) -> dict[str, float]:
    """Action kind ("F", "B", "I", "W", "OPT") -> the mean seconds of its computes over
    every chunk, rank and traced step: the costs to simulate a run with."""
    found: dict[str, list[float]] = {}
    for ranks in spans.values():
        for rank_spans in ranks.values():
            for action, kind, seconds in rank_spans:
                if kind == "update" or kind in KINDS:
                    found.setdefault(parse(action).kind.value, []).append(seconds)
    return {kind: statistics.mean(seconds) for kind, seconds in found.items()}


def split_cost(split: Spans, fused: Spans) -> dict:
    """Per chunk and over all chunks: B of the fused run, I and W of the split run (mean
    ms and counts), and the ratio above. "all" sums the chunks' means: a step runs each
    chunk's backward once per microbatch either way."""
    ours, theirs = durations(split), durations(fused)
    chunks = sorted({chunk for chunk, _ in theirs})
    per_chunk: dict[int, dict] = {}
    for chunk in chunks:
        b, i, w = theirs.get((chunk, "B"), []), ours.get((chunk, "I"), []), ours.get((chunk, "W"), [])
        if not (b and i and w):
            raise ValueError(f"chunk {chunk}: traces hold {len(b)} B (fused run), {len(i)} I and {len(w)} W "
                             f"(split run); the ratio needs some of each")
        b_ms, i_ms, w_ms = (1e3 * statistics.mean(seconds) for seconds in (b, i, w))
        f_fused, f_split = (1e3 * statistics.mean(run[(chunk, "F")]) for run in (theirs, ours))
        per_chunk[chunk] = {"backward_ms": b_ms, "input_ms": i_ms, "weight_ms": w_ms, "ratio": (i_ms + w_ms) / b_ms,
                            "forward_ms_fused_run": f_fused, "forward_ms_split_run": f_split,
                            "ratio_per_forward": ((i_ms + w_ms) / f_split) / (b_ms / f_fused),
                            "counts": [len(b), len(i), len(w)],
                            "fused_in_split_run": len(ours.get((chunk, "B"), []))}
    total_b = sum(c["backward_ms"] for c in per_chunk.values())
    total_iw = sum(c["input_ms"] + c["weight_ms"] for c in per_chunk.values())
    f_fused = sum(c["forward_ms_fused_run"] for c in per_chunk.values())
    f_split = sum(c["forward_ms_split_run"] for c in per_chunk.values())
    return {"chunks": per_chunk, "all": {"backward_ms": total_b, "split_ms": total_iw, "ratio": total_iw / total_b,
                                         "ratio_per_forward": (total_iw / f_split) / (total_b / f_fused)}}


def split_table(results: dict[str, dict]) -> str:
    """One row per (comparison, chunk) and one per comparison for all its chunks."""
    rows = []
    for label, result in results.items():
        for chunk, c in result["chunks"].items():
            rows.append([label, str(chunk), f"{c['backward_ms']:.2f}", f"{c['input_ms']:.2f}",
                         f"{c['weight_ms']:.2f}", f"{c['ratio']:.3f}",
                         f"{c['forward_ms_fused_run']:.2f} / {c['forward_ms_split_run']:.2f}",
                         f"{c['ratio_per_forward']:.3f}", "/".join(map(str, c["counts"]))])
        a = result["all"]
        rows.append([label, "all", f"{a['backward_ms']:.2f}", "", "", f"{a['ratio']:.3f}", "",
                     f"{a['ratio_per_forward']:.3f}", ""])
    return table(["split vs fused", "chunk", "B ms (fused)", "I ms", "W ms", "(I+W)/B", "F ms fused / split run",
                  "(I+W)/B per F", "spans B/I/W"], rows)
