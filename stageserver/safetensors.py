"""Parameter files in the safetensors format, through the `safetensors` library (no
pickle): written under a temporary name and renamed, so a reader never sees half a file."""

from __future__ import annotations

import hashlib
import os
import pathlib
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Writes atomically (temporary name, then rename); returns the file's SHA-256."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    os.close(fd)
    try:
        save_file({name: t.detach().contiguous() for name, t in tensors.items()}, tmp, metadata=metadata)
        digest = hashlib.sha256(pathlib.Path(tmp).read_bytes()).hexdigest()
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return digest


def open(path: str | os.PathLike):
    """The file for reading tensors one at a time (`keys`, `get_tensor`, `metadata`)."""
    return safe_open(str(path), framework="pt")


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors by name, the file's string metadata)."""
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata() or {}
    return load_file(str(path)), metadata
