"""Periodic checkpoints of the whole training state, and resuming them under other
layouts, microbatch counts included, on the shared cluster: every resumed run equals the
run that was never stopped, step for step (DESIGN.md, "The equivalence contract"; issues
8 and 17)."""

from __future__ import annotations

import json
import pathlib

import pytest

from interleaf.coordinator.checkpoints import Checkpoint, find
from interleaf.coordinator.config import ROPE_SCALING
from tests.conftest import LLAMA, TINY, layout_free, reference, run_job
from tests.test_equivalence import LOSS_RTOL

STEPS = ["train.steps=8"]
# Each layout differs from the one before in every dimension it can, the microbatch count
# included (4, 2, 4, 8): a step's samples depend on none of them, so the reference, run
# at TINY's 4, holds every hop.
CHAIN = [
    ["parallel.dp=2", "parallel.tp=2", "parallel.pp=2", "parallel.vpp=2", "parallel.zero=3"],
    ["parallel.tp=4", "parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b", "parallel.zero=0",
     "parallel.microbatches=2"],
    ["parallel.dp=2", "parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b", "parallel.zero=2"],
    ["parallel.pp=4", "parallel.vpp=2", "parallel.microbatches=8"],
]


def _held_to_reference(steps, history, first: int) -> None:
    assert [s.step for s in steps] == list(range(first, len(history)))
    for got in steps:
        want = history[got.step]
        assert abs(got.loss - want.loss) <= LOSS_RTOL * abs(want.loss), (got.step, got.loss, want.loss)
        assert abs(got.grad_norm - want.grad_norm) <= LOSS_RTOL * abs(want.grad_norm), (got.step,)


# A Llama whose padded vocabulary changes size with tp on the way (512 rows at tp 2 and
# 4, 384 at tp 1), with a key/value head per rank at tp=4.
ARCHS = {"gpt2": [], "llama": LLAMA + ["model.n_kv_heads=4"]}


def resume_through(client, tmp_path, setup: list[str], chain: list[list[str]]) -> list[dict]:
    """Runs `setup` under each layout of `chain` in turn, each resuming from the
    checkpoint its predecessor wrote two steps after it took over, and holds every run
    to the reference of `setup`; returns the manifests resumed from."""
    history, _ = reference(layout_free(setup))
    resume, first, manifests = "", 0, []
    for hop, layout in enumerate(chain):
        folder = tmp_path / f"hop{hop}"
        settings = setup + layout + [f"checkpoint.dir={folder}", "checkpoint.every=2"]
        if resume:
            settings.append(f"checkpoint.resume={resume}")
        final, steps = run_job(client, settings)
        assert final.state == "SUCCEEDED", (hop, final.error)
        _held_to_reference(steps, history, first)
        # The next layout takes over two steps later than this one did.
        first += 2
        resume = str(folder / f"step-{first:06d}")
        manifests.append(find(resume).manifest)
    assert first == len(history)
    return manifests


@pytest.mark.parametrize("arch", ARCHS)
def test_resharding_through_four_layouts_equals_the_uninterrupted_run(client, tmp_path, arch):
    manifests = resume_through(client, tmp_path, TINY + ARCHS[arch] + STEPS, CHAIN)
    for hop, manifest in enumerate(manifests):
        assert manifest["layout"]["tp"] == (2, 4, 1, 1)[hop]
        assert manifest["consumed_samples"] == (hop + 1) * 2 * 8  # train.global_batch=8


def test_a_manifest_without_a_data_position_resumes_at_step_times_global_batch(tmp_path):
    """Checkpoints written before the data position was recorded ran every step at the
    job's global batch; those that record it are taken at their word."""
    assert Checkpoint(tmp_path / "manifest.json", {"step": 6}).consumed_samples(8) == 48
    assert Checkpoint(tmp_path / "manifest.json", {"step": 6, "consumed_samples": 40}).consumed_samples(8) == 40


def test_fp64_resume_in_the_same_layout_is_exact_and_keep_prunes(client, tmp_path):
    layout = ["parallel.dp=2", "parallel.zero=1", "train.precision=fp64"]
    final, whole = run_job(client, TINY + STEPS + layout + [f"checkpoint.dir={tmp_path}", "checkpoint.every=2",
                                                           "checkpoint.keep=2"])
    assert final.state == "SUCCEEDED", final.error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000006", "step-000008"]
    # What each save cost training (the copy) and what its background writes took.
    manifest = find(tmp_path).manifest
    assert manifest["stall_seconds"] > 0 and manifest["write_seconds"] > 0
    final, resumed = run_job(client, TINY + STEPS + layout + [f"checkpoint.resume={tmp_path / 'step-000006'}"])
    assert final.state == "SUCCEEDED", final.error
    assert [(s.step, s.loss, s.grad_norm) for s in resumed] == [(s.step, s.loss, s.grad_norm) for s in whole[6:]]


def test_a_checkpoint_root_resumes_from_its_newest_complete_step(client, tmp_path):
    final, whole = run_job(client, TINY + STEPS + [f"checkpoint.dir={tmp_path}", "checkpoint.every=4"])
    assert final.state == "SUCCEEDED", final.error
    (tmp_path / "step-000009").mkdir()  # a save cut short: no manifest, never read
    (tmp_path / "step-000008" / "manifest.json").unlink()  # and one whose manifest never came
    final, resumed = run_job(client, TINY + STEPS + [f"checkpoint.resume={tmp_path}"])
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in resumed] == [4, 5, 6, 7]
    assert [s.loss for s in resumed] == pytest.approx([s.loss for s in whole[4:]], rel=LOSS_RTOL)


def test_a_checkpoint_from_before_a_model_field_existed_resumes(client, tmp_path):
    """A manifest written before Llama 3's rope scaling fields holds their defaults."""
    final, whole = run_job(client, TINY + STEPS + [f"checkpoint.dir={tmp_path}", "checkpoint.every=4"])
    assert final.state == "SUCCEEDED", final.error
    manifest = tmp_path / "step-000004" / "manifest.json"
    saved = json.loads(manifest.read_text())
    saved["model"] = {k: v for k, v in saved["model"].items() if k not in ROPE_SCALING}
    manifest.write_text(json.dumps(saved))
    final, resumed = run_job(client, TINY + STEPS + [f"checkpoint.resume={manifest}"])
    assert final.state == "SUCCEEDED", final.error
    assert [s.loss for s in resumed] == pytest.approx([s.loss for s in whole[4:]], rel=LOSS_RTOL)


@pytest.mark.parametrize("change,message", [
    (["model.d_model=64"], "holds a model of shape"),
    (["train.steps=4"], "is at step 4: nothing is left of train.steps=4"),
])
def test_a_resume_that_cannot_continue_fails_naming_why(client, tmp_path, change, message):
    final, _ = run_job(client, TINY + STEPS + [f"checkpoint.dir={tmp_path}", "checkpoint.every=4"])
    assert final.state == "SUCCEEDED"
    final, steps = run_job(client, TINY + STEPS + change + [f"checkpoint.resume={tmp_path / 'step-000004'}"])
    assert final.state == "FAILED"
    assert message in final.error
    assert steps == []
    assert all(s.state == "IDLE" for s in client.servers())


def test_a_job_never_writes_among_another_runs_checkpoints(client, tmp_path):
    """A fresh job whose checkpoint.dir holds another run's checkpoints is refused before
    it trains (its step 4 would sit beside the old run's step 8, and export, generate,
    --resume and checkpoint.keep take the newest), and so is a job resumed from an older
    step there; the old checkpoints are left as they were. Continuing the newest in
    its own folder is the one way to write there."""
    folder = tmp_path / "ck"
    final, _ = run_job(client, TINY + STEPS + [f"checkpoint.dir={folder}", "checkpoint.every=4"])
    assert final.state == "SUCCEEDED"
    old = {p: p.read_bytes() for p in sorted(folder.glob("step-*/*"))}
    job = json.loads((folder / "step-000008" / "manifest.json").read_text())["job"]
    for resume, start, held in (([], "a fresh start", "4, 8"),
                                ([f"checkpoint.resume={folder / 'step-000004'}"], "its step 4", "8")):
        final, steps = run_job(client, TINY + ["train.steps=12", f"checkpoint.dir={folder}", "checkpoint.every=4"]
                               + resume)
        assert final.state == "FAILED" and steps == []
        assert final.error == (f"checkpoint.dir={str(folder)!r} already holds checkpoints of another run beyond "
                               f"{start} (job {job}: step {held}): this job's would be mixed with them; resume "
                               "from them (--resume / checkpoint.resume), or give an empty checkpoint.dir")
        assert {p: p.read_bytes() for p in sorted(folder.glob("step-*/*"))} == old
    final, steps = run_job(client, TINY + ["train.steps=12", f"checkpoint.dir={folder}", "checkpoint.every=4",
                                           f"checkpoint.resume={folder}"])
    assert final.state == "SUCCEEDED" and [s.step for s in steps] == [8, 9, 10, 11]
    assert sorted(p.name for p in folder.glob("step-*")) == ["step-000004", "step-000008", "step-000012"]


def test_a_corrupt_state_file_is_refused_by_name(client, tmp_path):
    final, _ = run_job(client, TINY + STEPS + [f"checkpoint.dir={tmp_path}", "checkpoint.every=4"])
    assert final.state == "SUCCEEDED"
    state = pathlib.Path(tmp_path / "step-000004" / "state-00001.safetensors")
    state.write_bytes(state.read_bytes()[:-8] + b"\0" * 8)
    final, _ = run_job(client, TINY + STEPS + [f"checkpoint.resume={tmp_path / 'step-000004'}"])
    assert final.state == "FAILED"
    assert final.error == f"checkpoint file {state} is corrupt: its SHA-256 differs from the manifest's"


def test_interleaf_run_resume_continues_where_the_checkpoint_left_off(client, tmp_path):
    import json
    import subprocess
    import sys

    # A WSD schedule whose decay straddles the resume: the lr is a function of the step.
    wsd = ["train.lr_decay=wsd", "train.decay_fraction=0.75", "train.min_lr_ratio=0.2"]
    final, whole = run_job(client, TINY + STEPS + wsd + [f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=4"])
    assert final.state == "SUCCEEDED"
    sets = [a for s in TINY + STEPS + wsd for a in ("--set", s)]
    result = subprocess.run([sys.executable, "-m", "interleaf.clients.cli", "run", *sets, "--resume",
                             str(tmp_path / "ck" / "step-000004"), "--metrics-out", str(tmp_path / "m.jsonl")],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    resumed, steps = records[0], records[1:]
    assert resumed["checkpoint"] == "resumed" and resumed["step"] == 4 and resumed["load_seconds"] > 0
    assert resumed["manifest"] == str(tmp_path / "ck" / "step-000004" / "manifest.json")
    assert "resumed at step 4" in result.stderr
    assert [s["step"] for s in steps] == [4, 5, 6, 7]
    assert [s["loss"] for s in steps] == pytest.approx([s.loss for s in whole[4:]], rel=LOSS_RTOL)
    assert [s["lr"] for s in steps] == [s.lr for s in whole[4:]]
    assert len({s.lr for s in whole[3:]}) == 5  # decaying all along


def test_a_checkpoint_dir_the_coordinator_cannot_write_fails_the_job_naming_it(client, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    final, steps = run_job(client, TINY + STEPS + [f"checkpoint.dir={blocker / 'ck'}"])
    assert final.state == "FAILED" and steps == []
    assert final.error == (f"checkpoint.dir={str(blocker / 'ck')!r} cannot be written by the coordinator: "
                           f"Not a directory")
