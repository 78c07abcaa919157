"""A job that diverges stops at the first non-finite step, naming it, and keeps no
checkpoint taken after it (issue 10's non-finite guard)."""

from __future__ import annotations

import math
import re

from interleaf.coordinator.checkpoints import find
from tests.conftest import TINY, run_job


def test_a_job_with_lr_1e30_fails_at_its_first_non_finite_step(client, tmp_path):
    root = tmp_path / "ck"
    final, steps = run_job(client, TINY + ["train.steps=8", "train.lr=1e30", "train.warmup_steps=0",
                                           "parallel.dp=2", "parallel.pp=1", "parallel.vpp=1", f"checkpoint.dir={root}", "checkpoint.every=1"])
    assert final.state == "FAILED"
    match = re.search(r"step (\d+): non-finite (loss|gradient norm) \S+.* on rank (\d+); the job stops here",
                      final.error)
    assert match, final.error
    bad = int(match.group(1))
    # Every step reported before it was finite, and none after it ran to the end.
    assert [s.step for s in steps] == list(range(bad))
    assert all(math.isfinite(s.loss) and math.isfinite(s.grad_norm) for s in steps)
    # Nothing after the last good step was saved: the newest checkpoint is the state after
    # the steps before the bad one.
    saved = sorted(p.name for p in root.glob("step-*") if (p / "manifest.json").exists())
    assert bad > 0 and find(root).step == bad
    assert all(int(name.split("-")[1]) <= bad for name in saved)
