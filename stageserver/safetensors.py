"""Parameter files in the safetensors format, through the `safetensors` library (no
pickle): written under a temporary name and renamed, so a reader never sees half a file."""

from __future__ import annotations

import hashlib
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from interleaf.common.durable import fsync_folder, temporary_beside


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Writes durably and atomically (a temporary name, fsync, rename, the folder
    fsynced); returns the file's SHA-256, hashed from the bytes written rather than
    read back."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = save({name: t.detach().contiguous() for name, t in tensors.items()}, metadata=metadata)
    digest = hashlib.sha256(data).hexdigest()
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_folder(path.parent)
    return digest


def open(path: str | os.PathLike):
    """The file for reading tensors one at a time (`keys`, `get_tensor`, `metadata`)."""
    return safe_open(str(path), framework="pt")


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name, the file's string metadata)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    return load_file(str(path)), metadata
