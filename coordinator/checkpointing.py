"""A job's checkpoints as the coordinator drives them: saves in the background, and
resume, with or without a filesystem shared with the stage servers.

Where the files live: every checkpoint is whole in `checkpoint.dir` on the
coordinator's host (`step-NNNNNN/state-RRRRR.safetensors` per rank, then
`manifest.json`). At setup each server is asked whether it reads a probe file the
coordinator wrote there (and the manifest it resumes from) with the same bytes. A server
that does shares the filesystem and reads and writes the files in place. One that does
not writes into its spool (stageserver/spool.py); once its file is complete the
coordinator streams it out (ReadFile) into the checkpoint and checks its SHA-256 against
the writer's; to resume, it streams the state files into the server's spool (WriteFile,
checked on arrival) and the server loads them from there. Either way the manifest names
every file relative to its own folder, so a checkpoint folder can be moved or copied
whole.

A save stalls training only for the copies out of the training buffers (SaveState);
writing, moving and the manifest then happen on a thread here while training goes on,
and the next save, or the job's end, waits for that thread first.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import pathlib
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import grpc

from interleaf.common.durable import temporary_beside
from interleaf.common.model.config import ModelShape, shape_of
from interleaf.coordinator.checkpoints import (Checkpoint, CheckpointError, find, prune,
                                               refuse_foreign_checkpoints, write_manifest)
from interleaf.coordinator.data_split import SplitChanged, job_split, resumed_split
from interleaf.coordinator.jobs import JobRecord
from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos import interleaf_pb2_grpc as rpc

log = logging.getLogger("interleaf.coordinator")

CHUNK_BYTES = 1 << 20
RPC_TIMEOUT_S = 600.0


class Checkpointing:
    def __init__(self, job: JobRecord, fan_out: Callable, rpc_error: Callable[[int, grpc.RpcError], Exception]):
        self.job = job
        self.fan_out = fan_out  # runs fn(rank, stub) on every rank at once
        self.rpc_error = rpc_error
        config = job.config.checkpoint
        self.root = pathlib.Path(config.dir).resolve() if config.dir else None
        self.resume_from: Checkpoint | None = None
        self.restart_from = config.resume  # checkpoint.resume, then after a recovery the newest saved
        self.probe: pathlib.Path | None = None
        self.shares_root: list[bool] = []    # per rank: reads checkpoint.dir in place
        self.shares_resume: list[bool] = []  # per rank: reads the resumed checkpoint in place
        self.saved_step: int | None = None   # the newest save started
        # The attempt's data position, (step, samples consumed before it): the resumed
        # checkpoint's, else the job's start. A save records the samples consumed since.
        self.data_start: tuple[int, int] = (0, 0)
        # The train/validation split the attempt runs under (coordinator/data_split.py):
        # the job's, or the resumed checkpoint's, which its manifests then record.
        self.split: dict = job_split(job.config)
        self._save: _Save | None = None  # the save under way
        self._lock = threading.Lock()  # a save's end (manifest, prune, events) against its abandonment

    # -- before setup ---------------------------------------------------------------

    def probes(self) -> list[pb.FileRef]:
        """Checks the checkpoint to resume from (before any server is set up) and
        returns the files each server is asked whether it sees: a probe in
        checkpoint.dir, and the manifest to resume from."""
        job, probes = self.job, []
        if self.root is not None:
            token = secrets.token_hex(16).encode()
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                (self.root / f".probe-{job.job_id}").write_bytes(token)
                self.probe = self.root / f".probe-{job.job_id}"
            except OSError as err:
                raise CheckpointError(f"checkpoint.dir={job.config.checkpoint.dir!r} cannot be written by the "
                                      f"coordinator: {err.strerror}") from None
            probes.append(pb.FileRef(path=str(self.probe), sha256=hashlib.sha256(token).hexdigest()))
        self.split = job_split(job.config)  # a resumed checkpoint's replaces it (_check_resume)
        self.resume_from = resumed = self._check_resume(self.restart_from) if self.restart_from else None
        if self.root is not None:
            refuse_foreign_checkpoints(self.root, job.job_id, resumed.step if resumed else 0,
                                       job.config.checkpoint.dir)
        self.data_start = (resumed.step, resumed.consumed_samples(job.config.train.global_batch)) if resumed else (0, 0)
        if self.resume_from is not None:
            manifest = self.resume_from.manifest_path
            probes.append(pb.FileRef(path=str(manifest), sha256=hashlib.sha256(manifest.read_bytes()).hexdigest()))
        return probes

    def _check_resume(self, where: str) -> Checkpoint:
        config = self.job.config
        checkpoint = find(where)
        saved_model = checkpoint.manifest.get("model")
        # A manifest from before a model field existed (Llama 3's rope scaling) holds its default.
        if saved_model is None or ModelShape(**saved_model) != shape_of(config.model):
            raise CheckpointError(f"checkpoint.resume={where!r} holds a model of shape {saved_model}, "
                                  f"this job's is {dataclasses.asdict(config.model)}")
        try:
            self.split = resumed_split(checkpoint.manifest.get("data_split"), config, where)
        except SplitChanged as err:
            raise CheckpointError(str(err)) from None
        if checkpoint.step >= config.train.steps:
            raise CheckpointError(f"checkpoint.resume={where!r} is at step {checkpoint.step}: nothing is "
                                  f"left of train.steps={config.train.steps}")
        return checkpoint

    def recover(self) -> None:
        """After a lost server, or to grow back (parallel.elastic): the next attempt
        starts from the newest checkpoint this job completed, else from where the job
        started."""
        self.saved_step = None
        if self.job.checkpoint:
            self.restart_from = self.job.checkpoint

    def set_up(self, replies: list[pb.SetupReply]) -> None:
        """Takes each server's answer to the probes."""
        seen = [list(r.probes_seen) for r in replies]
        has_root = self.root is not None
        self.shares_root = [s[0] if has_root else False for s in seen]
        self.shares_resume = [s[int(has_root)] if self.resume_from else False for s in seen]
        apart = [rank for rank, shares in enumerate(self.shares_root) if not shares]
        if has_root and apart:
            log.info("job %s: ranks %s do not share checkpoint.dir %s; their files are moved over gRPC",
                     self.job.job_id, apart, self.root)

    # -- resume ---------------------------------------------------------------------

    def resume(self, stubs: list[rpc.StageServerStub]) -> int:
        """Loads the checkpoint into every rank, each under this job's layout; returns
        its step. The learning rate is a function of the step, the data order of the
        samples consumed (set up from `data_start`)."""
        job, checkpoint = self.job, self.resume_from
        started = time.perf_counter()
        paths = checkpoint.files()
        entries = checkpoint.manifest["state"]

        def load(rank, stub):
            try:
                if self.shares_resume[rank]:
                    names = [str(p) for p in paths]
                else:
                    names = [f"resume/{p.name}" for p in paths]
                    for path, name, entry in zip(paths, names, entries):
                        stub.WriteFile(_chunks(job.job_id, path, name, entry["sha256"]), timeout=RPC_TIMEOUT_S)
                return stub.LoadState(pb.LoadRequest(job_id=job.job_id, paths=names), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                raise self.rpc_error(rank, err) from None

        # Every file is checked against its size and SHA-256 while the ranks load (a
        # failed check fails the job before it trains on what was loaded).
        with ThreadPoolExecutor(max_workers=1) as pool:
            verified = pool.submit(checkpoint.paths)
            try:
                self.fan_out(load, stubs)
            except Exception:
                verified.result()  # a damaged file explains a failed load best
                raise
            verified.result()
        seconds = time.perf_counter() - started
        job.step = checkpoint.step
        job.add_checkpoint(pb.CheckpointEvent(
            kind="resumed", step=checkpoint.step, manifest=str(checkpoint.manifest_path), load_seconds=seconds,
            bytes=sum(e["bytes"] for e in entries)))
        log.info("job %s resumes at step %d, sample %d, from %s (loaded in %.3fs)", job.job_id, checkpoint.step,
                 self.data_start[1], checkpoint.manifest_path, seconds)
        return checkpoint.step

    # -- saves ----------------------------------------------------------------------

    def save(self, stubs: list[rpc.StageServerStub], layout: dict) -> None:
        """Every rank copies its state out of the training buffers (all that training
        waits for) and writes it in the background; the rest happens on a thread."""
        started = time.perf_counter()  # training waits from here: for the previous save too
        self.finish()
        job = self.job
        folder = self.root / f"step-{job.step:06d}"
        names = [f"{folder.name}/state-{r:05d}.safetensors" for r in range(len(stubs))]

        def copy(rank, stub):
            path = str(self.root / names[rank]) if self.shares_root[rank] else names[rank]
            try:
                stub.SaveState(pb.SaveRequest(job_id=job.job_id, path=path, background=True), timeout=RPC_TIMEOUT_S)
            except grpc.RpcError as err:
                raise self.rpc_error(rank, err) from None

        self.fan_out(copy, stubs)
        stall = time.perf_counter() - started
        self.saved_step = job.step
        start_step, start_samples = self.data_start
        manifest = {
            "job": job.job_id,
            "step": job.step,
            "consumed_samples": start_samples + (job.step - start_step) * job.config.train.global_batch,
            "layout": layout,
            "model": dataclasses.asdict(job.config.model),  # what export, generate and resume check
            "tokenizer": _tokenizer(job.config.data.tokenizer),  # what `export --format hf` writes beside it
            "precision": job.config.train.precision,
            "stall_seconds": stall,  # training waited this long
            # The train/validation split and validation set, which a resume keeps.
            "data_split": dict(self.split),
        }
        save = self._save = _Save()
        save.thread = threading.Thread(target=self._complete, args=(save, stubs, folder, names, manifest),
                                       name=f"checkpoint-{job.job_id}-{job.step}", daemon=True)
        save.thread.start()

    def finish(self, timeout_s: float | None = None) -> None:
        """Waits for the save under way; a save that failed fails the job here. One still
        running after `timeout_s` is abandoned: it writes no manifest, prunes nothing,
        reports nothing (its files stay, unlisted, in a folder without a manifest)."""
        save, self._save = self._save, None
        if save is None:
            return
        save.thread.join(timeout_s)
        with self._lock:
            if save.thread.is_alive():
                save.abandoned = True
                raise CheckpointError(f"the checkpoint of step {save.step} did not complete in {timeout_s:.0f} s")
        if save.failure is not None:
            raise save.failure

    def _complete(self, save: "_Save", stubs, folder: pathlib.Path, names: list[str], manifest: dict) -> None:
        """Waits for every rank's write, moves the files of ranks that do not share
        checkpoint.dir, then writes the manifest (last) and prunes."""
        job, started = self.job, time.perf_counter()

        def complete(rank, stub):
            try:
                reply = stub.FinishSaves(pb.JobRef(job_id=job.job_id), timeout=RPC_TIMEOUT_S)
                if len(reply.files) != 1:
                    raise CheckpointError(f"rank {rank} wrote {len(reply.files)} files for one save")
                written = reply.files[0]
                if not self.shares_root[rank]:
                    _pull(stub, job.job_id, names[rank], self.root / names[rank], written.sha256)
                return written
            except grpc.RpcError as err:
                raise self.rpc_error(rank, err) from None

        save.step = manifest["step"]
        try:
            written = self.fan_out(complete, stubs)
            manifest["state"] = [{"rank": r, "path": pathlib.PurePosixPath(names[r]).name, "sha256": w.sha256,
                                  "bytes": w.bytes} for r, w in enumerate(written)]
            manifest["write_seconds"] = time.perf_counter() - started  # in the background
            with self._lock:
                if save.abandoned:
                    return
                path = write_manifest(folder / "manifest.json", manifest)
                removed = prune(self.root, job.config.checkpoint.keep)
                job.checkpoint = path
        except Exception as err:  # raised to the driver by finish()
            log.error("job %s: the checkpoint of step %d failed: %s", job.job_id, manifest["step"], err)
            save.failure = err
            return
        job.add_checkpoint(pb.CheckpointEvent(
            kind="saved", step=manifest["step"], manifest=path, stall_seconds=manifest["stall_seconds"],
            write_seconds=manifest["write_seconds"], bytes=sum(w.bytes for w in written)))
        log.info("checkpoint %s: training stalled %.3fs, written in %.3fs%s", folder, manifest["stall_seconds"],
                 manifest["write_seconds"], f"; removed {[p.name for p in removed]}" if removed else "")

    def close(self) -> None:
        if self.probe is not None:
            try:
                self.probe.unlink(missing_ok=True)
            except OSError as err:  # never written: checkpoint.dir was not a folder
                log.debug("probe %s: %s", self.probe, err)


@dataclass
class _Save:
    """One save's completion, which the driver may wait for or abandon."""
    thread: threading.Thread | None = None
    step: int = 0
    failure: Exception | None = None
    abandoned: bool = False


def _tokenizer(spec: str) -> str:
    """data.tokenizer as a manifest records it: a path made absolute here, where it was
    checked (relative paths are the submitter's and the coordinator's working folder)."""
    return spec if spec == "bytes" else os.path.abspath(os.path.expanduser(spec))


def _chunks(job_id: str, path: pathlib.Path, name: str, sha256: str):
    """A file as WriteFile's stream: the first chunk names it."""
    yield pb.FileChunk(job_id=job_id, path=name, sha256=sha256)
    with open(path, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            yield pb.FileChunk(data=data)


def _pull(stub, job_id: str, name: str, target: pathlib.Path, sha256: str) -> None:
    """Streams a file out of a server's spool into `target` (a temporary name, renamed
    once its bytes match the writer's SHA-256)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = temporary_beside(target)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in stub.ReadFile(pb.FileRef(job_id=job_id, path=name), timeout=RPC_TIMEOUT_S):
                digest.update(chunk.data)
                f.write(chunk.data)
        if digest.hexdigest() != sha256:
            raise CheckpointError(f"{target} arrived with SHA-256 {digest.hexdigest()}, its writer "
                                  f"reported {sha256}")
        os.replace(tmp, target)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
