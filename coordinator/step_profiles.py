"""The torch profiler's Chrome traces and the CUDA memory snapshots of a traced step
(trace.torch_profiler, trace.memory_snapshot; stageserver/profiling.py), written beside
the action timeline `interleaf trace --out T.json` writes: T.rank0.torch.json, ... one per
rank (open each in ui.perfetto.dev), and T.rank0.memory_snapshot.pickle, ... (drop each
on pytorch.org/memory_viz). Worked example: `--out /tmp/s1.json` for a step of 2 ranks
profiled writes /tmp/s1.rank0.torch.json and /tmp/s1.rank1.torch.json."""

from __future__ import annotations

import gzip
import pathlib
from collections.abc import Iterable

from interleaf.protos import interleaf_pb2 as pb


def profile_paths(out: str, rank: int) -> tuple[pathlib.Path, pathlib.Path]:
    """(Chrome trace, memory snapshot) of `rank` beside the timeline `out`."""
    base = pathlib.Path(out)
    stem = base.name[:-len(base.suffix)] if base.suffix else base.name
    return (base.with_name(f"{stem}.rank{rank}.torch.json"),
            base.with_name(f"{stem}.rank{rank}.memory_snapshot.pickle"))


def write_profiles(out: str, reports: Iterable[pb.StepReport]) -> list[pathlib.Path]:
    """Writes the profile and snapshot each report carries (`interleaf trace` passes the
    profiled ranks' reports as it fetches them, one at a time); the paths written."""
    written = []
    for report in reports:
        trace_path, snapshot_path = profile_paths(out, report.rank)
        for data, path in ((report.torch_profile, trace_path), (report.memory_snapshot, snapshot_path)):
            if data:
                path.write_bytes(gzip.decompress(data))
                written.append(path)
    return written
