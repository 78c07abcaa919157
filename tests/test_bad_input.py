"""Bad input at the command line and over gRPC: one clear line, nothing started, no
server left holding state."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import numpy as np
import pytest

from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc
from interleaf.common import wire
from interleaf.stageserver.data import write_tokens
from tests.conftest import TINY, run_job
from tests.test_config import BAD_CONFIGS



def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "interleaf.clients.cli", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m.split()[0] for _, m in BAD_CONFIGS])
def test_cli_run_refuses_bad_config_and_starts_nothing(overrides, message):
    result = _cli("run", *[arg for o in overrides for arg in ("--set", o)])
    assert result.returncode == 2
    assert result.stderr == f"error: {message}\n"
    assert "starting" not in result.stdout + result.stderr


def test_cli_checks_local_count_against_layout():
    result = _cli("run", "--local", "3", "--set", "parallel.pp=2")
    assert result.returncode == 2
    assert result.stderr == "error: --local 3 must equal parallel.dp*parallel.tp*parallel.pp=2\n"


def test_cli_missing_config_file():
    result = _cli("schedule", "/nonexistent/job.toml")
    assert result.returncode == 2
    assert result.stderr == "error: config file '/nonexistent/job.toml' does not exist\n"


@pytest.mark.parametrize("overrides,message", BAD_CONFIGS, ids=[m.split()[0] for _, m in BAD_CONFIGS])
def test_grpc_submit_answers_invalid_argument(client, overrides, message):
    with pytest.raises(grpc.RpcError) as caught:
        client.submit("", overrides)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == message
    assert all(s.state == "IDLE" for s in client.servers())


def _holds_job(cluster, address: str, job_id: str) -> bool:
    stub = rpc.StageServerStub(wire.channel(address, cluster.security))
    try:
        list(stub.RunSteps(pb.RunStepsRequest(job_id=job_id, first_step=0, num_steps=1), timeout=10))
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
        return False
    return True


def test_job_rejected_by_servers_fails_cleanly(cluster, client, tmp_path):
    missing = tmp_path / "absent.tokens"
    final, steps = run_job(client, TINY + ["parallel.pp=2", "parallel.vpp=1", f"data.source={missing}"])
    assert final.state == "FAILED"
    assert steps == []
    assert f"data.source={str(missing)!r}: no token file" in final.error
    assert final.error.startswith("rank ")
    assert not any(_holds_job(cluster, r.server_address, final.job_id) for r in final.ranks)
    assert all(s.state == "IDLE" for s in client.servers())


def test_vocabulary_smaller_than_data_is_refused_at_submission(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.submit("", TINY + ["parallel.pp=2", "parallel.vpp=1", "model.vocab_size=128"])
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(
        "model.vocab_size=128 is smaller than the vocabulary of data.source='builtin' (256, from its tokenizer)")
    assert all(s.state == "IDLE" for s in client.servers())


def test_token_ids_beyond_the_vocabulary_are_refused_by_servers(cluster, client, tmp_path):
    path = tmp_path / "ids.tokens"
    write_tokens(path, np.arange(1000) % 256)  # a sidecar that records no vocabulary: the ids tell
    final, _ = run_job(client, TINY + ["parallel.pp=2", "parallel.vpp=1", "model.vocab_size=128",
                                       f"data.source={path}"])
    assert final.state == "FAILED"
    assert "model.vocab_size=128 must exceed every token id" in final.error
    assert not any(_holds_job(cluster, r.server_address, final.job_id) for r in final.ranks)


def test_cancel_stops_a_running_job_and_frees_servers(cluster, client):
    status = client.submit("", TINY + ["parallel.pp=2", "parallel.vpp=1", "train.steps=100000"])
    events = client.watch(status.job_id, timeout_s=120)
    for event in events:
        if event.HasField("step"):
            break
    client.cancel(status.job_id)
    states = [e.status.state for e in events if e.HasField("status")]
    final = client.status(status.job_id)
    assert final.state == "CANCELLED" and states[-1] == "CANCELLED"
    assert final.step < 100000
    assert not any(_holds_job(cluster, r.server_address, status.job_id) for r in final.ranks)
    assert all(s.state == "IDLE" for s in client.servers())


def test_a_job_cancelled_while_it_sets_up_frees_its_servers_at_once(client):
    """A cancel that lands while the job's servers set up and connect (Ctrl-C of a plan
    waiting on its profile job, say): the job stops where that phase ends, rather than
    have one server torn down while its peers wait out the 120 s communication timeout
    for it, holding every server of the job."""
    for delay in (0.0, 0.01, 0.02, 0.03, 0.05, 0.1):
        job_id = client.submit("", TINY + ["parallel.pp=2", "parallel.vpp=1", "parallel.dp=2",
                                           "train.steps=5"]).job_id
        time.sleep(delay)
        cancelled = time.monotonic()
        client.cancel(job_id)
        final, _ = client.wait(job_id, timeout_s=60)
        assert final.state in ("CANCELLED", "SUCCEEDED"), (delay, final.state, final.error)
        assert time.monotonic() - cancelled < 10, (delay, time.monotonic() - cancelled)
        assert all(s.state == "IDLE" for s in client.servers()), delay


def test_unknown_job_is_not_found(client):
    with pytest.raises(grpc.RpcError) as caught:
        client.status("job-0-nope")
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_paths_and_settings_a_run_cannot_use_are_refused_before_anything_starts(tmp_path, capsys):
    """What a user probe met as tracebacks, or as failures after the local cluster had
    started: each now one line naming the flag or setting, exit 2, nothing started."""
    from interleaf.clients.cli import main

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"[train]\nsteps = 3\n\xff\n")
    top_level = tmp_path / "top.toml"
    top_level.write_text("steps = 3\n")
    cases = [
        (["run", "--metrics-out", str(tmp_path)], f"--metrics-out {str(tmp_path)!r} is a folder"),
        (["run", "--metrics-out", "/nonexistent/dir/m.jsonl"], "its folder '/nonexistent/dir' does not exist"),
        (["reference", "--metrics-out", str(tmp_path)], "is a folder; it must name the JSON-lines file"),
        (["run", "--log-dir", str(a_file)], f"--log-dir {str(a_file)!r} is a file"),
        (["run", "--device", "cpu", "--set", "parallel.transport=nccl"],
         "parallel.transport='nccl' cannot move tensors on cpu servers (they need 'gloo')"),
        (["run", "--resume", "/nonexistent/ckpt"], "checkpoint.resume: checkpoint '/nonexistent/ckpt' does not exist"),
        (["config", str(binary)], "is not UTF-8 text, as TOML must be (byte 18: b'\\xff')"),
        (["config", str(tmp_path)], f"config file {str(tmp_path)!r} is a folder"),
        (["config", str(top_level)], "steps=3 is outside any section: settings go in a table, e.g. [train] steps"),
        (["schedule", "--png", str(tmp_path / "x.txt")], "must name a .png file"),
        (["schedule", "--png", str(tmp_path / "noext")], "must name a .png file"),
        (["schedule", "--png", "/nonexistent/x.png"], "its folder '/nonexistent' does not exist"),
        (["servers", "--coordinator", ""], "--coordinator '' must be HOST:PORT"),
        (["config", "--set", "train.compile=maybe"], "train.compile='maybe' must be true, false or \"auto\""),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        captured = capsys.readouterr()
        assert message in captured.err, (argv, captured.err)
        assert "Traceback" not in captured.err and "starting" not in captured.out + captured.err
    assert not list(tmp_path.glob("noext*")) and not (tmp_path / "x.txt").exists()
    assert main(["config", "--set", "train.compile=ON"]) == 0
    assert 'compile = "on"' in capsys.readouterr().out
