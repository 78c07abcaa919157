"""--metrics-out's rows are typed (clients/follow.py, MetricsOut): every row of
`interleaf run` (steps, evaluations, checkpoints saved, the one resumed from) and of
`interleaf reference` carries a "kind" from ROW_KINDS and that kind's keys, written by
the command line as a user runs it: a local pipeline cluster, checkpointing every step,
then a second run resuming from the first's checkpoint. Recovery rows are checked where
a recovery happens (tests/test_coordinator_restart.py)."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from interleaf.clients.follow import ROW_KINDS, MetricsOut

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.global_batch=4",
         "parallel.microbatches=2", "train.warmup_steps=1"]
PIPELINE = ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]
EVAL = ["eval.every=2", "eval.samples=8", "eval.fraction=0.05"]
STEP_KEYS = {"kind", "step", "loss", "tokens", "step_seconds", "tokens_per_second", "grad_norm", "lr"}


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args], capture_output=True, text=True,
                          timeout=300, env=os.environ, cwd=ROOT)


def _sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


def _rows(path) -> list[dict]:
    rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]
    unknown = [r for r in rows if r.get("kind") not in ROW_KINDS]
    assert rows and not unknown, unknown
    return rows


def _kinds(rows) -> list[tuple]:
    """Each row's kind, with what says which of its kind it is."""
    return [(r["kind"], r.get("checkpoint"), r["step"]) for r in rows if r["kind"] != "step"]


def test_every_row_of_a_checkpointed_resumed_evaluated_run_has_its_kind(tmp_path):
    ck = tmp_path / "ck"
    first = _cli("run", "--local", "2", *_sets(SMALL + PIPELINE + EVAL + ["train.steps=3", f"checkpoint.dir={ck}",
                                                                          "checkpoint.every=1"]),
                 "--metrics-out", str(tmp_path / "first.jsonl"))
    assert first.returncode == 0, first.stderr[-3000:]
    rows = _rows(tmp_path / "first.jsonl")
    assert [r["step"] for r in rows if r["kind"] == "step"] == [0, 1, 2]
    assert all(STEP_KEYS | {"bubble_seconds", "idle_seconds", "ranks"} <= set(r) for r in rows if r["kind"] == "step")
    assert sorted(_kinds(rows), key=lambda k: (k[2], k[0])) == [
        ("checkpoint", "saved", 1), ("checkpoint", "saved", 2), ("eval", None, 2), ("checkpoint", "saved", 3),
        ("eval", None, 3)]

    resumed = _cli("run", "--local", "2", *_sets(SMALL + PIPELINE + EVAL + ["train.steps=4", f"checkpoint.dir={ck}",
                                                                            "checkpoint.every=1"]),
                   "--resume", str(ck), "--metrics-out", str(tmp_path / "resumed.jsonl"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _rows(tmp_path / "resumed.jsonl")
    assert rows[0]["kind"] == "checkpoint" and rows[0]["checkpoint"] == "resumed" and rows[0]["step"] == 3
    assert rows[0]["load_seconds"] > 0 and "stall_seconds" not in rows[0]
    assert [r["step"] for r in rows if r["kind"] == "step"] == [3]
    assert sorted(_kinds(rows)[1:]) == [("checkpoint", "saved", 4), ("eval", None, 4)]

    reference = _cli("reference", *_sets(SMALL + EVAL + ["train.steps=3", "parallel.pp=1", "parallel.vpp=1",
                                                         "parallel.schedule=1f1b"]),
                     "--metrics-out", str(tmp_path / "reference.jsonl"))
    assert reference.returncode == 0, reference.stderr[-3000:]
    rows = _rows(tmp_path / "reference.jsonl")
    assert [(r["kind"], r["step"]) for r in rows] == [("step", 0), ("step", 1), ("eval", 2), ("step", 2),
                                                      ("eval", 3)]
    assert all(set(r) == STEP_KEYS for r in rows if r["kind"] == "step")


def test_a_row_without_a_known_kind_is_refused_by_name(tmp_path):
    metrics = MetricsOut(str(tmp_path / "m.jsonl"))
    refused = r"^kind='status' must be one of step, eval, checkpoint, recovery, grow for a --metrics-out row$"
    with pytest.raises(ValueError, match=refused):
        metrics.write("status", state="RUNNING")
    metrics.close()
    assert (tmp_path / "m.jsonl").read_text() == ""
