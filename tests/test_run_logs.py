"""TensorBoard and W&B (coordinator/run_logs.py): a real job's scalars written by the
Python client, by the coordinator (metrics.tensorboard_dir) and by `interleaf run` and
`interleaf reference`, read back with TensorBoard's own reader and from W&B's offline run
file; and the bad inputs (a relative or unwritable folder, --wandb without wandb)."""

from __future__ import annotations

import glob
import json
import math
import os
import pathlib
import signal
import struct
import subprocess
import sys

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.config import ConfigError, load_config
from interleaf.coordinator.job_logs import start_job_logs
from interleaf.coordinator.jobs import JobRecord
from interleaf.coordinator.registry import Registry
from interleaf.coordinator.run_logs import RunLogs, TensorBoardSink
from interleaf.protos import interleaf_pb2 as pb
from interleaf.common.security import TOKEN_ENV

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = ["model.n_layers=2", "model.d_model=32", "model.n_heads=2", "model.seq_len=16", "train.steps=3",
         "train.global_batch=4", "parallel.microbatches=2", "train.warmup_steps=1"]
PIPELINE = ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b"]
SOLO = ["parallel.pp=1", "parallel.vpp=1", "parallel.schedule=1f1b"]  # the reference's one process
EVAL = ["eval.every=2", "eval.samples=8", "eval.fraction=0.05"]  # after steps 2 and 3 (the end)


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every event file under `folder`, as TensorBoard reads them."""
    files = glob.glob(f"{folder}/**/events.out.tfevents.*", recursive=True)
    assert files, f"no event files under {folder}"
    found = {}
    for file in files:
        acc = EventAccumulator(file)
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            found.setdefault(tag, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return found


def cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, cwd=ROOT)


def sets(overrides):
    return [a for o in overrides for a in ("--set", o)]


@pytest.fixture(scope="module")
def logged_job(cluster, tmp_path_factory):
    """One pp=2 job followed by the Python client into a TensorBoard folder, with the
    coordinator writing its own: (its step events, the client's folder, the coordinator's)."""
    mine, theirs = tmp_path_factory.mktemp("tb-client"), tmp_path_factory.mktemp("tb-coordinator")
    with cluster.connect() as api:
        job = api.submit("", SMALL + PIPELINE + EVAL + [f"metrics.tensorboard_dir={theirs}"])
        assert job.wait(timeout_s=300, tensorboard=mine).state == "SUCCEEDED"
        events = list(api.rpc.watch(job.id))
    return events, mine, theirs / job.id


def test_the_clients_tensorboard_files_hold_every_step(logged_job):
    events, mine, _ = logged_job
    steps = [e.step for e in events if e.HasField("step")]
    found = scalars(mine)
    assert [s for s, _ in found["train/loss"]] == [1, 2, 3]  # steps completed
    for tag, field in (("train/loss", "loss"), ("train/lr", "lr"), ("train/grad_norm", "grad_norm"),
                       ("train/tokens_per_second", "tokens_per_second"),
                       ("pipeline/bubble_seconds", "bubble_seconds"), ("pipeline/idle_seconds", "idle_seconds")):
        assert [v for _, v in found[tag]] == pytest.approx([getattr(s, field) for s in steps], rel=1e-6), tag
    # Memory by kind: the rank that needs the most; MFU from the servers' default peaks.
    assert [v for _, v in found["memory/activations_peak_bytes"]] == [
        max(r.activations_peak_bytes for r in s.ranks) for s in steps]
    assert {"memory/optimizer_bytes", "memory/communication_peak_bytes", "memory/peak_bytes"} <= set(found)
    assert all(0 < v < 1 for _, v in found["train/mfu"])
    assert "memory/device_peak_bytes" not in found  # CPU servers have no device high-water mark
    evals = [e.eval for e in events if e.HasField("eval")]
    assert [s for s, _ in found["eval/loss"]] == [e.step for e in evals] == [2, 3]
    assert [v for _, v in found["eval/loss"]] == pytest.approx([e.loss for e in evals], rel=1e-6)
    assert [v for _, v in found["eval/perplexity"]] == pytest.approx([e.perplexity for e in evals], rel=1e-6)


def test_the_coordinator_writes_the_same_scalars(logged_job):
    _, mine, theirs = logged_job
    assert scalars(theirs) == scalars(mine)


def test_the_coordinators_job_logs_are_on_disk_before_the_event_is_published(tmp_path):
    """coordinator/job_logs.py in one process, on a real JobRecord: each step and
    evaluation is in the files when add_step/add_eval return (no thread to wait for,
    nothing in the writer's queue), the final state closes them, and nothing after it
    opens a new file."""
    job = JobRecord("j1", load_config("", SMALL + PIPELINE + [f"metrics.tensorboard_dir={tmp_path}"]))
    logs = start_job_logs(job, Registry())
    for step in range(3):
        job.add_step(pb.StepEvent(step=step, loss=5.0 - step, lr=1e-3))
        assert scalars(tmp_path / "j1")["train/loss"] == [(k + 1, 5.0 - k) for k in range(step + 1)]
    job.add_eval(pb.EvalEvent(step=3, loss=4.5, perplexity=math.exp(4.5)))
    assert scalars(tmp_path / "j1")["eval/loss"] == [(3, 4.5)]
    assert not logs.closed
    job.set_state("SUCCEEDED")
    assert logs.closed
    job.add_step(pb.StepEvent(step=3, loss=1.0))  # published after the end: not written, no second file
    assert len(glob.glob(f"{tmp_path}/j1/events.out.tfevents.*")) == 1
    assert [s for s, _ in scalars(tmp_path / "j1")["train/loss"]] == [1, 2, 3]


def test_a_stopping_coordinator_closes_the_job_logs_of_unfinished_jobs(tmp_path):
    job = JobRecord("j2", load_config("", SMALL + PIPELINE + [f"metrics.tensorboard_dir={tmp_path}"]))
    logs = start_job_logs(job, Registry())
    job.add_step(pb.StepEvent(step=0, loss=5.0))
    job.close_listeners()  # what CoordinatorService.close_job_logs does for each job on SIGTERM
    assert logs.closed and not job.listeners
    job.add_step(pb.StepEvent(step=1, loss=4.0))
    assert scalars(tmp_path / "j2")["train/loss"] == [(1, 5.0)]


def test_the_coordinators_files_hold_each_step_as_it_is_seen_and_survive_sigterm(tmp_path):
    """A step a watcher sees is in the coordinator's files already (flushed as it is
    published, not up to SummaryWriter's flush_secs later); a coordinator stopped with
    SIGTERM mid-job closes them, its driver threads ending without a word."""
    board = tmp_path / "tb"
    with LocalCluster(2, threads_per_server=1, log_dir=str(tmp_path / "logs"), steps_per_call=1) as cluster:
        client = cluster.client()
        job_id = client.submit("", SMALL + PIPELINE + ["train.steps=200", f"metrics.tensorboard_dir={board}"]).job_id
        seen = []
        for event in client.watch(job_id, timeout_s=300):
            if event.HasField("step"):
                seen.append(event.step)
                found = scalars(board / job_id)  # at once, as the step event arrives
                assert [s for s, _ in found["train/loss"]][:len(seen)] == [s.step + 1 for s in seen]
                if len(seen) == 3:
                    break
        client.close()
        coordinator = cluster.processes[0]
        coordinator.send_signal(signal.SIGTERM)
        assert coordinator.wait(timeout=60) == 0
        losses = scalars(board / job_id)["train/loss"]
        assert [s for s, _ in losses] == list(range(1, len(losses) + 1)) and len(losses) >= 3
        assert [v for _, v in losses[:3]] == pytest.approx([s.loss for s in seen], rel=1e-6)
        assert "Traceback" not in (tmp_path / "logs" / "coordinator.log").read_text()


def test_a_relative_tensorboard_dir_is_refused():
    with pytest.raises(ConfigError, match=r"metrics.tensorboard_dir='runs' must be an absolute path"):
        load_config("", ["metrics.tensorboard_dir=runs"])


def test_an_unwritable_tensorboard_dir_fails_the_job_before_any_server(client, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status = client.submit("", SMALL + PIPELINE + [f"metrics.tensorboard_dir={blocker}"])
    final, steps = client.wait(status.job_id, timeout_s=60)
    assert final.state == "FAILED" and not steps
    assert f"metrics.tensorboard_dir={str(blocker)!r}: cannot write" in final.error
    assert not final.ranks  # failed before it was planned onto servers


def test_eval_events_become_eval_scalars(tmp_path):
    """EvalEvent (steps completed when scored) at its step, beside the training scalars."""
    logs = RunLogs([TensorBoardSink(str(tmp_path))])
    logs.event(pb.JobEvent(step=pb.StepEvent(step=2, loss=5.0, lr=1e-3)))
    logs.event(pb.JobEvent(eval=pb.EvalEvent(step=3, loss=4.5, perplexity=math.exp(4.5), seconds=0.25)))
    logs.event(pb.JobEvent(checkpoint=pb.CheckpointEvent(kind="saved", step=3)))  # no scalars
    logs.close()
    found = scalars(tmp_path)
    assert found["eval/loss"] == [(3, 4.5)] and found["train/loss"] == [(3, 5.0)]
    assert found["eval/perplexity"] == [(3, pytest.approx(math.exp(4.5), rel=1e-6))]
    assert "train/mfu" not in found  # no model given: no MFU rather than a wrong one


def test_interleaf_run_writes_tensorboard(tmp_path):
    """The command line, as a user runs it: a local pipeline cluster of its own."""
    result = cli("run", "--local", "2", *sets(SMALL + PIPELINE + EVAL), "--tensorboard", str(tmp_path / "tb"),
                 "--metrics-out", str(tmp_path / "m.jsonl"))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    steps, evals = [r for r in rows if r["kind"] == "step"], [r for r in rows if r["kind"] == "eval"]
    found = scalars(tmp_path / "tb")
    assert [v for _, v in found["train/loss"]] == pytest.approx([r["loss"] for r in steps], rel=1e-6)
    assert [v for _, v in found["train/lr"]] == pytest.approx([r["lr"] for r in steps], rel=1e-6)
    assert [r["step"] for r in evals] == [2, 3]
    assert found["eval/loss"] == [(r["step"], pytest.approx(r["loss"], rel=1e-6)) for r in evals]
    # the progress output: a line per evaluation, and the bar carries the latest one
    for r in evals:
        assert f"eval after step {r['step']}: loss {r['loss']:.4f}, perplexity {r['perplexity']:,.2f}" in result.stderr
    assert "step 3/3 " in result.stderr and f"eval {evals[0]['loss']:.4f} (ppl " in result.stderr


def test_interleaf_watch_writes_tensorboard(cluster, client, tmp_path):
    status = client.submit("", SMALL + PIPELINE)
    result = cli("watch", status.job_id, "--coordinator", cluster.address, "--tensorboard", str(tmp_path),
                 env={TOKEN_ENV: cluster.security.token})
    assert result.returncode == 0, result.stderr[-3000:]
    assert [s for s, _ in scalars(tmp_path)["train/loss"]] == [1, 2, 3]


def wandb_history(wandb_dir) -> list[dict]:
    """The rows an offline W&B run logged, read from its .wandb file: W&B's record log
    (a 7-byte header, then LevelDB-log framing in 32 KiB blocks: crc32, length, type,
    data; a Record split over blocks is FIRST, MIDDLE..., LAST) of wandb's own protobuf
    Records; the history ones are the logged rows."""
    from wandb.proto import wandb_internal_pb2 as wpb

    (path,) = glob.glob(f"{wandb_dir}/wandb/offline-run-*/run-*.wandb")
    data = pathlib.Path(path).read_bytes()
    assert data[:4] == b":W&B"
    rows, pending, offset, block = [], b"", 7, 32768
    while offset + 7 <= len(data):
        if block - offset % block < 7:  # a block's tail too short for a header is padding
            offset += block - offset % block
            continue
        _, length, kind = struct.unpack("<IHB", data[offset:offset + 7])
        if kind == 0:
            break
        pending += data[offset + 7:offset + 7 + length]
        offset += 7 + length
        if kind in (1, 4):  # FULL or LAST
            record = wpb.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in record.history.item})
    return rows


def test_reference_logs_to_tensorboard_and_wandb_offline(tmp_path):
    result = cli("reference", *sets(SMALL + SOLO + EVAL), "--metrics-out", str(tmp_path / "m.jsonl"),
                 "--tensorboard", str(tmp_path / "tb"), "--wandb", "interleaf-test",
                 env={"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if r["kind"] == "step"]
    found = scalars(tmp_path / "tb")
    assert [v for _, v in found["train/loss"]] == pytest.approx(losses, rel=1e-6)
    evals = [(r["step"], r["loss"]) for r in rows if r["kind"] == "eval"]
    assert len(evals) == 2 and found["eval/loss"] == [(s, pytest.approx(v, rel=1e-6)) for s, v in evals]
    history = [h for h in wandb_history(tmp_path) if "train/loss" in h]
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert [h["train/loss"] for h in history] == pytest.approx(losses, rel=1e-12)
    assert [h["train/lr"] for h in history] == pytest.approx([r["lr"] for r in rows if "lr" in r], rel=1e-12)
    assert [(h["_step"], h["eval/loss"]) for h in wandb_history(tmp_path) if "eval/loss" in h] == evals


@pytest.mark.parametrize("command", [["run", "--local", "2", *sets(PIPELINE)], ["reference", *sets(SOLO)]])
def test_wandb_without_the_extra_is_refused_before_anything_starts(command, tmp_path):
    """wandb made unimportable, as where the extra is not installed."""
    args = [*command, *sets(SMALL), "--wandb", "p", "--metrics-out", str(tmp_path / "m.jsonl")]
    code = ("import sys; sys.modules['wandb'] = None; from interleaf.clients.cli import main; "
            f"sys.exit(main({args!r}))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "pip install 'interleaf[wandb]'" in result.stderr
    assert "starting a coordinator" not in result.stderr and not (tmp_path / "m.jsonl").exists()


@pytest.mark.parametrize("command", [["run", "--local", "2", *sets(PIPELINE)], ["reference", *sets(SOLO)]])
def test_an_unwritable_tensorboard_folder_is_refused_before_anything_starts(command, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = cli(*command, *sets(SMALL), "--tensorboard", str(blocker / "tb"), "--metrics-out", str(tmp_path / "m.jsonl"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"--tensorboard {str(blocker / 'tb')!r}: the event files' folder cannot be written" in result.stderr
    assert "starting a coordinator" not in result.stderr and not (tmp_path / "m.jsonl").exists()
