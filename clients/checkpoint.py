"""Reading what a job saved: find a checkpoint, check its files, reassemble full tensors.

A checkpoint is a folder `step-NNNNNN/` under `checkpoint.dir` holding one safetensors
file per rank (parameters under their global names; a tensor-parallel shard records its
slice) and `manifest.json`, written last through a rename, which lists every file with
its SHA-256 and size and the model's shape. A folder without a manifest is incomplete
(a save that did not finish) and is never read.
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from dataclasses import dataclass

import torch

from stageserver import safetensors
from stageserver.model import GPTConfig

MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be read, named with the file at fault."""


@dataclass(frozen=True)
class Checkpoint:
    manifest_path: pathlib.Path
    manifest: dict

    @property
    def root(self) -> pathlib.Path:
        """The folder the manifest's file paths are relative to (`checkpoint.dir`)."""
        return self.manifest_path.parent.parent

    @property
    def step(self) -> int:
        return self.manifest["step"]

    @property
    def model(self) -> GPTConfig:
        if "model" not in self.manifest:
            raise CheckpointError(f"{self.manifest_path} does not record the model's shape "
                                  f"(written by an older Interleaf)")
        return GPTConfig(**self.manifest["model"])


def find(path: str | pathlib.Path) -> Checkpoint:
    """The checkpoint at `path`: a manifest, a `step-NNNNNN` folder, or a checkpoint
    root, where the newest complete step (one with a manifest) is taken."""
    path = pathlib.Path(path)
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


def load_parameters(checkpoint: Checkpoint) -> dict[str, torch.Tensor]:
    """Every parameter as its full tensor, by global name: tensor-parallel slices joined.
    Each file is checked against the manifest's size and SHA-256 first; a missing,
    truncated or altered file is refused by name."""
    slices: dict[str, dict[int, torch.Tensor]] = {}
    dims: dict[str, int] = {}
    full: dict[str, torch.Tensor] = {}
    for entry in checkpoint.manifest["files"]:
        path = checkpoint.root / entry["path"]
        _verify(path, entry)
        tensors, meta = safetensors.read(path)
        layout = json.loads(meta.get("tp_slices", "{}"))
        for name, tensor in tensors.items():
            if name in layout:
                dim, rank, _ = (int(x) for x in layout[name].split(":"))
                slices.setdefault(name, {})[rank] = tensor
                dims[name] = dim
            else:
                full[name] = tensor
    for name, parts in slices.items():
        full[name] = torch.cat([parts[r] for r in sorted(parts)], dim=dims[name])
    return full


def _verify(path: pathlib.Path, entry: dict) -> None:
    if not path.exists():
        raise CheckpointError(f"checkpoint file {path} is missing")
    data = path.read_bytes()
    if "bytes" in entry and len(data) < entry["bytes"]:
        raise CheckpointError(f"checkpoint file {path} is truncated: {len(data)} bytes, the manifest "
                              f"expects at least {entry['bytes']}")
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} is corrupt: its SHA-256 differs from the manifest's")
