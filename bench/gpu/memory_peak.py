"""What a traced step holds at its peak, from a CUDA memory snapshot (trace.memory_snapshot):
the allocations made during the step and still live when the allocator's count was highest,
grouped by where they were made, to find what the memory model leaves out (the float8 GPT
rows of docs/gpus.md exceed it by 0.6 GiB, the bf16 ones by 0.07).

A snapshot (torch.cuda.memory._snapshot) holds the allocator's segments at its end, each
block with its state and requested size, and the events recorded since recording began
(device_traces, per device), each with its action, address, requested size and frames,
innermost first. torch.cuda.max_memory_allocated counts a tensor from its "alloc" to its
"free_requested" (a free waiting on another stream's use, "free_completed" later, no
longer counts), so replaying those two gives the step's allocated bytes over time; what
was allocated before recording began (parameters, gradients, optimizer state) is the
end's allocated bytes less the step's net change, so that baseline + the highest running
sum is the step's peak. In requested bytes: the allocator rounds each block up (to 512
bytes, or a cached block's whole size), which max_memory_allocated counts and this does
not; `rounding_bytes_at_end` says how much that was for the blocks live at the end.

Worked example: a baseline of 100 bytes (an active block of 100 at the end and no net
change), events alloc A 40 (made in blocks.py), alloc B 30 (made in fused_loss.py), free A,
alloc C 50 (blocks.py), free C, free B: running sums 40, 70, 30, 80, 30, 0, so the peak is
100 + 80 = 180, at the fourth event, when B (30, fused_loss.py) and C (50, blocks.py) are
live: groups [blocks.py 50, fused_loss.py 30].

    PYTHONPATH=. python bench/gpu/memory_peak.py SNAPSHOT.pickle [--top 15]
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
from typing import Any

from interleaf.stageserver.profiling import MAX_HISTORY_ENTRIES  # a trace that long may have lost its oldest

TOP = 15
OWN_CODE = "interleaf/"
"""A frame in Interleaf's own code (its repository's folders are linked under interleaf/,
and an installed package is named so): the innermost such frame says which part of a
chunk made an allocation, where the innermost Python frame is often inductor's generated
code or torch's."""
COUNTED = ("alloc", "free_requested")
NO_PYTHON = "no Python frame (autograd's thread: an eager backward, gradients accumulated)"


def where(frames: list[dict]) -> str:
    """An allocation's origin. Interleaf records Python stacks (stageserver/profiling.py);
    one recorded with C++ stacks too (torch's default) starts with the allocator's and the
    unwinder's own frames. The Python frames name it:
    its innermost in Interleaf's code, and its innermost of all where that is another
    ("fused_loss.py:190 head_loss < output_code.py:40 call"). An allocation with none was
    made on a thread without Python: autograd's own, running an eager backward (with C++
    frames, named by its node: "autograd MmBackward0")."""
    if not frames:
        return NO_PYTHON

    def named(frame: dict) -> str:
        return f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"

    python = [f for f in frames if f["filename"].endswith(".py")]
    if not python:
        node = next((found.group(0) for f in frames if (found := re.search(r"\w+Backward\w*", f["name"]))), None)
        return f"autograd {node}" if node else NO_PYTHON
    own = next((f for f in python if OWN_CODE in f["filename"]), None)
    if own is None:
        return named(python[0])
    return named(own) if own is python[0] else f"{named(own)} < {named(python[0])}"


def live_at_peak(snapshot: dict, top: int = TOP) -> dict[str, Any]:
    """The step's peak allocated bytes and what it made that was live then, grouped by
    `where`, largest first (the module's worked example), on the device whose trace
    holds the most events (a server computes on one). ValueError where no allocation or
    free was recorded."""
    traces = snapshot.get("device_traces", [])
    device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    trace = traces[device] if traces else []
    events = [e for e in trace if e.get("action") in COUNTED]
    if not events:
        raise ValueError("the snapshot recorded no allocation or free: was memory history recorded over the step?")
    live_blocks = [block for segment in snapshot.get("segments", []) if segment.get("device", device) == device
                   for block in segment.get("blocks", []) if block.get("state") == "active_allocated"]
    allocated_at_end = sum(block.get("requested_size", block["size"]) for block in live_blocks)
    net = sum(e["size"] if e["action"] == "alloc" else -e["size"] for e in events)
    baseline = allocated_at_end - net
    running, highest, at = 0, 0, -1
    for i, event in enumerate(events):
        running += event["size"] if event["action"] == "alloc" else -event["size"]
        if running > highest:
            highest, at = running, i
    live: dict[int, dict] = {}
    for event in events[:at + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        else:
            live.pop(event["addr"], None)
    groups: dict[str, list[int]] = {}
    for event in live.values():
        group = groups.setdefault(where(event.get("frames", [])), [0, 0])
        group[0] += event["size"]
        group[1] += 1
    ranked = sorted(groups.items(), key=lambda item: -item[1][0])
    return {
        "device": device,
        "baseline_bytes": baseline,
        "peak_bytes": baseline + highest,
        "step_bytes_at_peak": highest,
        "events": len(events),
        "truncated": len(trace) >= MAX_HISTORY_ENTRIES,
        "rounding_bytes_at_end": sum(block["size"] - block.get("requested_size", block["size"])
                                     for block in live_blocks),
        "live_at_peak": [{"where": name, "bytes": size, "allocations": count} for name, (size, count) in ranked[:top]],
        "others_bytes": sum(size for _, (size, _count) in ranked[top:]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("snapshot", help="a memory snapshot pickle (interleaf trace --out writes them)")
    parser.add_argument("--top", type=int, default=TOP, help="groups to list (default: %(default)s)")
    args = parser.parse_args()
    with open(args.snapshot, "rb") as f:
        print(json.dumps(live_at_peak(pickle.load(f), args.top), indent=1))


if __name__ == "__main__":
    main()
