"""Checkpoints when the stage servers do not share the coordinator's filesystem.

Each stage server runs in a mount namespace of its own, with a fresh tmpfs mounted over
the folder that holds the coordinator's checkpoint.dir: at the same path a server sees
an empty disk of its own, and its spool (inside that tmpfs) is invisible to the
coordinator, as on separate hosts. Saves must then reach the coordinator's folder over
gRPC, and resumes reach the servers the same way; the results must equal the reference
as they do with a shared filesystem.
"""

from __future__ import annotations

import hashlib
import subprocess

import pytest

from interleaf.clients.launcher import LocalCluster
from interleaf.coordinator.checkpoints import find
from interleaf.stageserver.spool import Spool
from tests.conftest import TINY, layout_free, reference
from tests.test_equivalence import LOSS_RTOL

SETTINGS = TINY + ["train.steps=6"]
ONE_STAGE = ["parallel.pp=1", "parallel.vpp=1"]


def _apart(disk):
    def command(i: int, argv: list[str]) -> list[str]:
        # unshare execs the shell, which mounts and execs the server: one process, whose
        # mounts vanish with it.
        return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                'mount -t tmpfs "server-disk" "$0" && exec "$@"', str(disk),
                *argv, "--spool-dir", str(disk / "spool")]
    return command


@pytest.fixture(scope="module")
def apart(tmp_path_factory):
    disk = tmp_path_factory.mktemp("coordinator-disk")
    logs = tmp_path_factory.mktemp("apart-logs")
    with LocalCluster(2, threads_per_server=1, log_dir=str(logs), server_command=_apart(disk)) as cluster:
        client = cluster.client()
        yield cluster, client, disk
        client.close()


def _run(client, overrides):
    status = client.submit("", overrides)
    events = list(client.watch(status.job_id, timeout_s=300))
    steps = [e.step for e in events if e.HasField("step")]
    checkpoints = [e.checkpoint for e in events if e.HasField("checkpoint")]
    return client.status(status.job_id), steps, checkpoints


def _in_server(cluster, i: int, *command: str) -> str:
    """Runs a command in server i's mount namespace: what that "host" sees."""
    pid = cluster.processes[1 + i].pid  # the coordinator is started first
    return subprocess.run(["nsenter", f"--target={pid}", "--mount", *command], capture_output=True, text=True,
                          check=True, timeout=30).stdout


def test_servers_apart_save_into_the_coordinators_folder_and_resume_from_it(apart):
    cluster, client, disk = apart
    root = disk / "ckpt"
    # The servers really are apart: the coordinator's folder is not there for them.
    root.mkdir()
    (root / "mine").write_text("the coordinator's")
    assert _in_server(cluster, 0, "ls", "-A", str(disk)) == ""
    (root / "mine").unlink()

    history, _ = reference(layout_free(SETTINGS))
    final, steps, saved = _run(client, SETTINGS + ONE_STAGE + ["parallel.dp=2", "parallel.zero=1", f"checkpoint.dir={root}",
                                                   "checkpoint.every=2"])
    assert final.state == "SUCCEEDED", final.error
    assert [c.kind for c in saved] == ["saved"] * 3 and [c.step for c in saved] == [2, 4, 6]
    for event in saved:
        checkpoint = find(event.manifest)
        paths = checkpoint.paths()  # both ranks' files, moved over, each matching its writer's SHA-256
        assert [p.name for p in paths] == ["state-00000.safetensors", "state-00001.safetensors"]
        assert event.bytes == sum(p.stat().st_size for p in paths) - sum(_header_bytes(p) for p in paths)
        assert event.stall_seconds > 0 and event.write_seconds > 0
    assert not list(root.glob(".probe-*"))  # the probe goes with the job
    # Each server's spool emptied: files leave it once the coordinator has them, and the
    # job's folder goes at teardown.
    for i in range(2):
        assert _in_server(cluster, i, "ls", "-A", str(disk / "spool")) == ""

    # Resumed from step 2 under another layout, the files streamed into the servers.
    final, steps, resumed = _run(client, SETTINGS + ["parallel.pp=2", "parallel.vpp=1", "parallel.schedule=1f1b",
                                                     f"checkpoint.resume={root / 'step-000002'}"])
    assert final.state == "SUCCEEDED", final.error
    assert [(c.kind, c.step) for c in resumed] == [("resumed", 2)] and resumed[0].load_seconds > 0
    assert [s.step for s in steps] == [2, 3, 4, 5]
    for got in steps:
        want = history[got.step]
        assert got.loss == pytest.approx(want.loss, rel=LOSS_RTOL)
        assert got.grad_norm == pytest.approx(want.grad_norm, rel=LOSS_RTOL)
    for i in range(2):
        assert _in_server(cluster, i, "ls", "-A", str(disk / "spool")) == ""


def _header_bytes(path) -> int:
    """A safetensors file's bytes beyond its tensors' (8-byte length, JSON header)."""
    with open(path, "rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def test_a_shared_checkpoint_resumes_on_servers_apart(apart, client, tmp_path):
    """Saved by servers that share the folder, resumed by servers that do not."""
    from tests.conftest import run_job
    root = tmp_path / "shared"
    final, whole = run_job(client, SETTINGS + ["parallel.tp=2", f"checkpoint.dir={root}", "checkpoint.every=3"])
    assert final.state == "SUCCEEDED", final.error
    _, apart_client, _ = apart
    final, steps, _ = _run(apart_client, SETTINGS + ONE_STAGE + ["parallel.dp=2", "parallel.zero=2",
                                                     f"checkpoint.resume={root / 'step-000003'}"])
    assert final.state == "SUCCEEDED", final.error
    assert [s.step for s in steps] == [3, 4, 5]
    for got, want in zip(steps, whole[3:]):
        assert got.loss == pytest.approx(want.loss, rel=LOSS_RTOL)


def test_the_spool_keeps_files_inside_it_and_refuses_bytes_that_do_not_match(tmp_path):
    spool = Spool(tmp_path, "job-1", 3)
    for bad in ("/etc/passwd", "../outside", "a/../../outside", ""):
        with pytest.raises(ValueError, match="must be relative and stay inside the spool"):
            spool.path(bad)
    with pytest.raises(ValueError, match="arrived with SHA-256"):
        spool.receive("resume/state-00000.safetensors", "0" * 64, [b"some", b"bytes"])
    assert not list(spool.folder.rglob("*.safetensors*"))  # nothing kept
    path, size = spool.receive("resume/x", hashlib.sha256(b"somebytes").hexdigest(), [b"some", b"bytes"])
    assert path.read_bytes() == b"somebytes" and size == 9
    assert b"".join(spool.read("resume/x")) == b"somebytes" and not path.exists()
    spool.remove()
    assert not spool.folder.exists()
