"""Where a profiled step's GPU time goes: the torch profiler traces bench/gpu/train.py
--profile-dir writes (one step each), reduced to time per kernel category and drawn as
one stacked bar per trace (docs/gpus.md shows the picture, not the traces).

Categories, by kernel name: matrix products (cuBLAS's nvjet and cutlass/gemm kernels),
attention (cuDNN's and flash SDPA), inductor's fused kernels (triton_*), the optimizer
(multi_tensor_apply: fused AdamW and the clipping norms), copies and fills (memcpy,
memset, dtype and layout copies), other elementwise and reduction kernels (eager ones:
the loss's chunks, norms, residual adds, gradient accumulation), and idle (the step's
span on the GPU not covered by any kernel). Each category sums its kernels' own times,
so kernels on two streams at once count in both, while idle is the span less the union
of all kernels: with overlap the bars add up to more than the span (one rank, as here,
overlaps little: its only other streams are the NCCL groups', idle with one member).

Beside the categories, each trace's costliest kernels by name (--kernels of them, their
calls and summed time): what the next change to the step should look at first, since
the categories say how much goes where but not which operations it is.

Against a peer (--against LABEL,PEER, the peer's trace taken as train.py takes it): per
category and per kernel name, LABEL's milliseconds less PEER's, the kernels that differ
most first - what one step runs that the other does not (Interleaf's fused loss against
a peer's [tokens x vocabulary] cross-entropy, bf16 parameters against autocast's casts),
which is where a ratio between the two comes from, since their blocks are the same model.

    python bench/gpu/profile_breakdown.py LABEL=TRACE.json.gz ... --png OUT.png [--json OUT.json] [--kernels 25]
        [--against LABEL,PEER ...]

The JSON: {"categories_ms": {label: {category: ms}}, "top_kernels": {label: [{"name",
"category", "calls", "ms"}, ...]}, "against": {label: {"peer": PEER, "categories_ms":
{category: ms}, "kernels": [{"name", "category", "ms", "peer_ms", "difference_ms"}, ...]}}}
("against" only with --against).
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib

from report import profile_lines  # bench/gpu/report.py: this script's directory is on the path

CATEGORIES = ("matrix products", "attention", "inductor fused", "other elementwise", "copies", "optimizer", "idle")
COLOURS = ("#4c72b0", "#8172b2", "#55a868", "#dd8452", "#937860", "#c44e52", "#dddddd")


def category(name: str) -> str:
    lowered = name.lower()
    if lowered.startswith("nvjet") or "gemm" in lowered or "cutlass" in lowered or "xmma" in lowered:
        return "matrix products"
    if "sdpa" in lowered or "flash" in lowered or "fmha" in lowered or "attention" in lowered:
        return "attention"
    if lowered.startswith("triton_"):
        return "inductor fused"
    if "multi_tensor_apply" in lowered:
        return "optimizer"
    if "memcpy" in lowered or "memset" in lowered or "copy_kernel" in lowered or "fillfunctor" in lowered:
        return "copies"
    return "other elementwise"


def _kernels(trace: dict) -> list[dict]:
    """The trace's GPU events: kernels, copies and fills."""
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not kernels:
        raise ValueError("the trace holds no GPU kernels (was it taken on a GPU?)")
    return kernels


NAME_CHARACTERS = 240
"""Where a kernel's name is cut in the output: templated ones run to thousands, while
casts to and from bf16 differ only past character 180. Kernels are told apart and
categorised by their whole names."""


def top_kernels(trace: dict, count: int, names: dict[str, tuple[int, float]] | None = None) -> list[dict]:
    """The `count` kernel names with the most summed time, each with its category, calls
    and milliseconds; `names`: the trace's per_name, where made already."""
    ranked = sorted((names or per_name(trace)).items(), key=lambda item: -item[1][1])[:count]
    return [{"name": name[:NAME_CHARACTERS], "category": category(name), "calls": calls, "ms": round(ms, 3)}
            for name, (calls, ms) in ranked]


def per_name(trace: dict) -> dict[str, tuple[int, float]]:
    """(calls, milliseconds) per kernel name."""
    totals: dict[str, tuple[int, float]] = {}
    for e in _kernels(trace):
        calls, ms = totals.get(e["name"], (0, 0.0))
        totals[e["name"]] = (calls + 1, ms + e["dur"] / 1e3)
    return totals


def versus(rows: dict[str, float], kernels: dict[str, tuple[int, float]], peer: str, peer_rows: dict[str, float],
           peer_kernels: dict[str, tuple[int, float]], count: int) -> dict:
    """One trace (its breakdown and per_name) against a peer's: per category and per
    kernel name, its milliseconds less the peer's; the `count` kernels whose times differ
    most, largest first (a kernel only one of them ran counts the other's as 0)."""
    ms = {name: value for name, (_, value) in kernels.items()}
    peer_ms = {name: value for name, (_, value) in peer_kernels.items()}
    difference = {n: round(ms.get(n, 0.0) - peer_ms.get(n, 0.0), 3) for n in set(ms) | set(peer_ms)}
    names = sorted(difference, key=lambda n: (-abs(difference[n]), n))[:count]  # as printed: equal ones by name
    return {"peer": peer,
            "categories_ms": {name: round(rows[name] - peer_rows[name], 3) for name in CATEGORIES},
            "kernels": [{"name": n[:NAME_CHARACTERS], "category": category(n), "ms": round(ms.get(n, 0.0), 3),
                         "peer_ms": round(peer_ms.get(n, 0.0), 3), "difference_ms": difference[n]} for n in names]}


def pairs(values: list[str], labels: list[str]) -> list[tuple[str, str]]:
    """--against's LABEL,PEER values, each naming two of the traces' labels (labels hold
    no comma), each LABEL set against one peer."""
    found: dict[str, str] = {}
    for value in values:
        label, _, peer = value.partition(",")
        if not peer or label not in labels or peer not in labels or label == peer:
            raise SystemExit(f"--against {value!r} must be LABEL,PEER: two different labels of the traces given "
                             f"({', '.join(labels)})")
        if label in found:
            raise SystemExit(f"--against {value!r}: {label} is set against {found[label]} already (one peer a label)")
        found[label] = peer
    return list(found.items())


def breakdown(trace: dict) -> dict[str, float]:
    """Milliseconds per category over the trace's GPU span (kernels, copies and fills)."""
    kernels = _kernels(trace)
    times = dict.fromkeys(CATEGORIES, 0.0)
    for e in kernels:
        times[category(e["name"])] += e["dur"] / 1e3
    intervals = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    covered, end = 0.0, intervals[0][0]
    for start, stop in intervals:  # the union of kernel intervals: overlapping streams count once
        if stop > end:
            covered += stop - max(start, end)
            end = stop
    span = max(stop for _, stop in intervals) - intervals[0][0]
    times["idle"] = (span - covered) / 1e3
    return times


def draw(rows: dict[str, dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.4 + 0.5 * len(rows)))
    labels = list(rows)
    left = [0.0] * len(labels)
    for name, colour in zip(CATEGORIES, COLOURS, strict=True):
        widths = [rows[label][name] for label in labels]
        ax.barh(labels, widths, left=left, color=colour, label=name, edgecolor="white", linewidth=0.5)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("GPU time in one step, ms")
    ax.invert_yaxis()
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="LABEL=PATH of a gzip-compressed Chrome trace")
    parser.add_argument("--png", required=True)
    parser.add_argument("--json")
    parser.add_argument("--kernels", type=int, default=25, help="how many of each trace's costliest kernels to list")
    parser.add_argument("--against", action="append", default=[], metavar="LABEL,PEER",
                        help="LABEL's trace against PEER's, per category and per kernel (repeatable, one PEER "
                        "a LABEL; labels hold no comma)")
    args = parser.parse_args()
    against = pairs(args.against, [item.rpartition("=")[0] for item in args.traces])  # before any trace is read
    rows, tops, names = {}, {}, {}
    for item in args.traces:
        label, _, path = item.rpartition("=")  # a label may hold "=" (train.compile=on), a path not
        trace = json.loads(gzip.decompress(pathlib.Path(path).read_bytes()))
        names[label] = per_name(trace)
        rows[label], tops[label] = breakdown(trace), top_kernels(trace, args.kernels, names[label])
    differences = {label: versus(rows[label], names[label], peer, rows[peer], names[peer], args.kernels)
                   for label, peer in against}
    draw(rows, args.png)
    result = {"categories_ms": rows, "top_kernels": tops, **({"against": differences} if differences else {})}
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    # The categories and each pair's differences as report.py prints them in a session's report.md
    print("\n".join(profile_lines(result, top=args.kernels)))
    for label, kernels in tops.items():
        print(f"\n{label}: the costliest kernels")
        for k in kernels:
            print(f"{k['ms']:>10.2f} ms {k['calls']:>6} calls  {k['category']:<18} {k['name'][:100]}")

if __name__ == "__main__":
    main()
