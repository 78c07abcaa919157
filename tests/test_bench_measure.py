"""bench/measure.py's record of where a benchmark ran: a result names the tree it
measured, so that a figure in the docs can be matched to its code."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_a_benchmark_records_the_commit_it_ran_and_whether_files_differed():
    sys.path.insert(0, str(ROOT / "bench"))
    from measure import machine

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD")
    changed = bool(git("status", "--porcelain", "--untracked-files=no"))
    assert machine()["tree"] == commit + ("+changes" if changed else "")
