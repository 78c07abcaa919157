"""A GPU session's results as the Markdown tables docs/gpus.md and docs/benchmarks.md
print: one table per train.py result, the memory check's (with what each case held at
its peak, where recorded), where the profiled steps' GPU time went (and where each
Interleaf side's differs from its peer's), float8's tracking of bf16, the planner's summary, each
headed by where and on what tree it was measured. bench/gpu/session.sh runs it at the
end of each phase, so the tables are in the session's log and need no GPU time to write.

    python bench/gpu/report.py DIR      # DIR: session.sh's $OUT (train_*.json, memory_*.json,
                                        # profile_breakdown.json, fp8_tracking*.json, planner.json)

Worked example: a train.py row {"side": "interleaf-compile", "median_step_seconds":
0.866, "tokens_per_second": 75712, "mfu_measured_peak": 0.744, "mfu_datasheet_peak":
0.587, "max_memory_allocated_bytes": 40.35e9, "loss_relative_difference_max": 7.65e-4}
prints `| interleaf-compile | 0.866 s | 75,712 | 74.4% | 58.7% | 37.6 GiB | 7.7e-04 |`.
"""

from __future__ import annotations

import argparse
import json
import pathlib

GIB = 2**30


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value / GIB:.1f} GiB"


def train_table(result: dict) -> list[str]:
    """train.py's result: its provenance, one row per side, each precision's ratio."""
    peak = result["measured_bf16_peak_flops"] / 1e12
    lines = [f"{result['arch']}, {result['device']}, torch {result['torch']}, {result['steps']} steps "
             f"(first {result['warmup']} left out), measured bf16 matrix rate {peak:.0f} TFLOP/s",
             "",
             f"| side | step | tokens/s | MFU ({peak:.0f}) | MFU (989) | peak memory | losses vs the first of its "
             f"precision, max |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in result["sides"]:
        diff = row["loss_relative_difference_max"]
        lines.append(f"| {row['side']} | {row['median_step_seconds']:.3f} s | {row['tokens_per_second']:,.0f} | "
                     f"{_percent(row['mfu_measured_peak'])} | {_percent(row['mfu_datasheet_peak'])} | "
                     f"{_gib(row['max_memory_allocated_bytes'])} | {'-' if diff is None else f'{diff:.1e}'} |")
    lines.append("")
    ratios = result["interleaf_over_best_peer"] or {}
    if "ratio" in ratios:  # a result from before each precision was ranked against its own peers
        ratios = {"best of all": ratios}
    for precision, ratio in ratios.items():
        lines.append(f"- {precision}: {ratio['interleaf_side']} / {ratio['peer_side']} tokens/s = "
                     f"**{ratio['ratio']:.3f}**")
    for side, error in result.get("failed", {}).items():
        lines.append(f"- {side}: FAILED {error[:300]}")
    return lines


def memory_table(cases: list[dict]) -> list[str]:
    """memory_check.py's cases: predicted against measured peak."""
    lines = ["| case | predicted | measured | what was measured | error |", "| --- | --- | --- | --- | --- |"]
    for case in cases:
        if "failed" in case:  # refused by admission, say (memory_check.py records why)
            lines.append(f"| {case['case']} | - | - | FAILED: {case['failed'][:200]} | - |")
            continue
        lines.append(f"| {case['case']} | {_gib(case['predicted_peak_bytes'])} | "
                     f"{_gib(case['measured_peak_bytes'])} | {case['measured']} | {100 * case['error']:+.1f}% |")
    return lines


def peak_lines(cases: list[dict], top: int = 6) -> list[str]:
    """What each case with a --peak-breakdown held at its peak (memory_peak.py), its
    largest groups, or why it has none."""
    lines = []
    for case in cases:
        held = case.get("peak_breakdown")
        if held is None:
            if "peak_breakdown_error" in case:
                lines.append(f"- {case['case']}: no peak breakdown: {case['peak_breakdown_error'][:200]}")
            continue
        cut = " (the history was cut: the peak may be earlier)" if held.get("truncated") else ""
        lines.append(f"- {case['case']}: at its peak {_gib(held['step_bytes_at_peak'])} allocated within the step "
                     f"over {_gib(held['baseline_bytes'])} held before it{cut}; the largest:")
        lines += [f"  - {group['bytes'] / 2**20:,.0f} MiB in {group['allocations']}: `{group['where']}`"
                  for group in held["live_at_peak"][:top]]
    return lines


def tracking_lines(result: dict) -> list[str]:
    """fp8_tracking.py's result: float8's losses against bf16's over a longer run, and
    each side's peak against the memory model (with what it held at its peak, on a GPU)."""
    losses = result["losses"]
    memory = ["", *memory_table(result["memory"]), *peak_lines(result["memory"])] if result.get("memory") else []
    if result.get("partial"):  # cut short after the bf16 job
        return [f"- {result['arch']} (d_model {result['model']['d_model']}, {result['model']['n_layers']} layers), "
                f"{result['device']}: cut short after {', '.join(losses)}; no comparison", *memory]
    return [f"- {result['arch']} (d_model {result['model']['d_model']}, {result['model']['n_layers']} layers), "
            f"{result['device']}, {result['steps']} steps: bf16 {losses['bf16'][0]:.3f} -> {losses['bf16'][-1]:.3f}, "
            f"fp8 {losses['fp8'][0]:.3f} -> {losses['fp8'][-1]:.3f}",
            f"- fp8 against bf16, relative: mean {result['mean']:.2%}, last quarter {result['last_quarter_mean']:.2%}, "
            f"largest {result['max']:.2%} (bounds {result['bounds']['mean']:.0%}, "
            f"{result['bounds']['last_quarter_mean']:.0%}, {result['bounds']['max']:.0%}): "
            f"{'tracks' if result['tracks'] else 'DOES NOT TRACK'}", *memory]


def profile_lines(result: dict, top: int = 8) -> list[str]:
    """profile_breakdown.py's result: milliseconds per kernel category, a column per
    profiled side, as docs/gpus.md's table; then, for each side set against its peer
    (--against), where the two steps differ most, kernel by kernel."""
    categories = result["categories_ms"]
    labels = list(categories)
    names = list(next(iter(categories.values()))) if categories else []
    lines = [f"| ms in one step | {' | '.join(labels)} |", f"| --- |{' --- |' * len(labels)}"]
    lines += [f"| {name} | {' | '.join(f'{categories[label][name]:.1f}' for label in labels)} |" for name in names]
    lines.append(f"| **step** | {' | '.join(f'{sum(categories[label].values()):.1f}' for label in labels)} |")
    for label, versus in result.get("against", {}).items():
        total = sum(versus["categories_ms"].values())
        by_category = ", ".join(f"{name} {ms:+.1f}" for name, ms in versus["categories_ms"].items())
        lines += ["", f"- {label} against {versus['peer']}: {total:+.1f} ms in all ({by_category}); the kernels "
                      f"that differ most:"]
        lines += [f"  - {k['difference_ms']:+.1f} ms ({k['ms']:.1f} against {k['peer_ms']:.1f}), {k['category']}: "
                  f"`{k['name']}`" for k in versus["kernels"][:top]]
    return lines


def planner_lines(result: dict) -> list[str]:
    """bench/planner.py's summary: the targets it holds."""
    if result.get("partial"):  # cut short: the runs it finished, with their predictions
        return [f"- cut short after {len(result['runs'])} layout(s); planned {result['plan']}", "",
                "| layout | measured step(s) | predicted |", "| --- | --- | --- |",
                *(f"| {r['layout']} | {', '.join(f'{m:.4f} s' for m in r['round_medians_s'])} | "
                  f"{r['predicted_step_s']:.4f} s |" for r in result["runs"])]
    s = result["summary"]
    # No default layout runs on one server (it is pp=2); no device peak on a CPU.
    default = ("; the default layout did not run" if s["planned_vs_default"] is None
               else f", {s['planned_vs_default']:.3f}x the default's")
    peak = "-" if s["planned_peak_error"] is None else f"{100 * s['planned_peak_error']:+.1f}%"
    return [f"- {result['device']}, {result['servers']} server(s), {result.get('rounds', 3)} round(s) of the grid: "
            f"Spearman {s['spearman']:.3f} (target >= 0.8), median |error| {100 * s['median_abs_error']:.1f}% "
            f"(<= 15%), worst {100 * s['worst_abs_error']:.1f}%",
            f"- planned {s['planned']}: {s['planned_vs_grid_best']:.3f}x the grid's best step ({s['grid_best']})"
            f"{default}",
            f"- the planned job's peak against the memory model: {peak}"]


def _memory_lines(cases: list[dict]) -> list[str]:
    held = peak_lines(cases)
    return [*memory_table(cases), *([""] + held if held else [])]


RENDERERS = (("train_*.json", train_table), ("memory_*.json", _memory_lines),
             ("profile_breakdown.json", profile_lines), ("fp8_tracking*.json", tracking_lines),
             ("planner.json", planner_lines))
"""Each result file session.sh's steps write, and its section of the report, in order."""


def report(folder: pathlib.Path) -> list[str]:
    """Every result in `folder` as its section; a file that cannot be read or rendered
    (a step killed mid-write, a result of an older shape) is one line saying so, and the
    others are still reported: the report is what a GPU lease brings back."""
    lines: list[str] = []
    for pattern, render in RENDERERS:
        for path in sorted(folder.glob(pattern)):
            try:
                section = render(json.loads(path.read_text()))
            except Exception as err:  # whatever it is, the other results are still reported
                section = [f"not reported: {type(err).__name__}: {err}"]
            lines += [f"### {path.name}", "", *section, ""]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=pathlib.Path)
    folder = parser.parse_args().folder
    if not folder.is_dir():
        parser.error(f"{folder} is not a folder of session.sh's results")
    print("\n".join(report(folder)))


if __name__ == "__main__":
    main()
