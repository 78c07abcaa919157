"""Checkpoints on disk, as the coordinator and the clients find them.

A checkpoint is a folder `step-NNNNNN/` under `checkpoint.dir` holding, per rank, a
state file (`state-NNNNN.safetensors`: master weights and Adam moments by global name,
stageserver/state_io.py; the master weights are the parameters), and `manifest.json`,
written last through a rename, which lists every file with its SHA-256 and size, the
model's shape, the layout, the step and the samples consumed before it (how the files get there: checkpointing.py). A folder without a manifest is
incomplete (a save that did not finish) and is never read, so a crash at any moment
leaves the previous checkpoint loadable.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from interleaf.common.durable import fsync_folder, temporary_beside

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, named with the file at fault."""


@dataclass(frozen=True)
class Checkpoint:
    manifest_path: pathlib.Path
    manifest: dict

    @property
    def folder(self) -> pathlib.Path:
        """The folder the manifest's file paths are relative to: its own, so a
        checkpoint can be moved or copied whole."""
        return self.manifest_path.parent

    @property
    def step(self) -> int:
        return self.manifest["step"]

    def consumed_samples(self, global_batch: int) -> int:
        """The samples trained on before its step: where the data order goes on from
        (stageserver/data/sampler.py). A manifest written before it was recorded is taken
        to have run every step at `global_batch`."""
        return self.manifest.get("consumed_samples", self.step * global_batch)

    def files(self) -> list[pathlib.Path]:
        """The state files, unchecked."""
        entries = self.manifest.get("state", [])
        if not entries:
            raise CheckpointError(f"{self.manifest_path} lists no state files (written by an older Interleaf)")
        return [self.folder / entry["path"] for entry in entries]

    def paths(self) -> list[pathlib.Path]:
        """The state files, each checked against the manifest first."""
        paths, entries = self.files(), self.manifest["state"]
        with ThreadPoolExecutor(max_workers=min(8, len(entries))) as pool:
            list(pool.map(verify, paths, entries))  # the first failure, in order, raised
        return paths


def find(path: str | pathlib.Path) -> Checkpoint:
    """The checkpoint at `path`: a manifest, a `step-NNNNNN` folder, or a checkpoint
    root, where the newest complete step (one with a manifest) is taken."""
    path = pathlib.Path(path).absolute()  # servers are handed its files by absolute path
    if path.is_dir() and not (path / MANIFEST).exists():
        steps = sorted(p for p in path.glob("step-*") if (p / MANIFEST).exists())
        if not steps:
            raise CheckpointError(f"checkpoint {str(path)!r} holds no complete checkpoint "
                                  f"(no step-*/{MANIFEST})")
        path = steps[-1]
    if path.is_dir():
        path = path / MANIFEST
    if not path.exists():
        raise CheckpointError(f"checkpoint {str(path)!r} does not exist")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path} is not a valid manifest: {err}") from None
    return Checkpoint(path, manifest)


def verify(path: pathlib.Path, entry: dict) -> None:
    """Refuses a missing, truncated or altered file, naming it; hashes it in chunks
    (hashlib lets other threads run meanwhile, so files verify in parallel)."""
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    size = path.stat().st_size
    if "bytes" in entry and size < entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated: {size} bytes, the manifest "
                              f"expects at least {entry['bytes']}")
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its SHA-256 differs from the manifest's")


def write_manifest(path: pathlib.Path, manifest: dict) -> str:
    """The manifest goes last, through a temporary name, fsync and a rename: a crash
    before it leaves no manifest, never a half-written one."""
    data = json.dumps(manifest, indent=2).encode()
    fd, tmp = temporary_beside(path)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_folder(path.parent)
    return str(path)


def refuse_foreign_checkpoints(root: pathlib.Path, job_id: str, start_step: int, given: str) -> None:
    """CheckpointError where `root` (checkpoint.dir) holds complete checkpoints of another
    job beyond the step this one starts from (0, or the resumed checkpoint's): its saves
    would sit among them, and the newest step, which resume, export, generate and
    checkpoint.keep take, could be either run's (a fresh run's step 6 beside an old run's
    step 9: `export` wrote the old run's weights, and keep=1 deleted the new run's). A
    job's own checkpoints (a recovery, a restarted coordinator, an elastic growth) and
    those up to the step it resumed from (a run continued in its own folder) are its
    history."""
    foreign: dict[str, list[int]] = {}
    for manifest_path in sorted(root.glob(f"step-*/{MANIFEST}")):
        try:
            manifest = json.loads(manifest_path.read_text())
            owner, step = manifest["job"], int(manifest["step"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a manifest this job could be confused with: find() names it where read
        if owner != job_id and step > start_step:
            foreign.setdefault(owner, []).append(step)
    if foreign:
        held = "; ".join(f"job {owner}: step {', '.join(map(str, steps))}" for owner, steps in foreign.items())
        start = f"its step {start_step}" if start_step else "a fresh start"
        raise CheckpointError(f"checkpoint.dir={given!r} already holds checkpoints of another run beyond {start} "
                              f"({held}): this job's would be mixed with them; resume from them "
                              f"(--resume / checkpoint.resume), or give an empty checkpoint.dir")


def prune(root: pathlib.Path, keep: int) -> list[pathlib.Path]:
    """Removes all but the newest `keep` complete checkpoints (0: keeps all); returns
    what it removed. Incomplete step folders older than the newest kept one go too."""
    complete = sorted(p for p in root.glob("step-*") if (p / MANIFEST).exists())
    if keep <= 0 or len(complete) <= keep:
        return []
    oldest_kept = complete[-keep]
    removed = [p for p in sorted(root.glob("step-*")) if p.name < oldest_kept.name]
    for folder in removed:
        shutil.rmtree(folder)
    return removed
