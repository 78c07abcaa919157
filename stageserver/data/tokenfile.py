"""Token files: a flat array of uint16 or uint32 token ids, read through a memory map,
with a small JSON sidecar (`NAME.json`) recording dtype, count and SHA-256 so every
stage server can prove it reads the same tokens."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import tempfile

import numpy as np

from interleaf.stageserver.data.tokenizer import encode

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def _sidecar(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".json")


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    # Written under a temporary name and renamed, so a reader (another local server
    # building the same cache) never sees half a file.
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def write_tokens(path: str | os.PathLike, tokens: np.ndarray) -> dict:
    """Writes `tokens` as the smallest dtype that holds them; returns the metadata."""
    path = pathlib.Path(path)
    tokens = np.asarray(tokens)
    dtype = "uint16" if tokens.size == 0 or int(tokens.max()) < 2**16 else "uint32"
    data = tokens.astype(DTYPES[dtype]).tobytes()
    meta = {"dtype": dtype, "tokens": int(tokens.size), "sha256": hashlib.sha256(data).hexdigest()}
    _atomic_write(path, data)
    _atomic_write(_sidecar(path), json.dumps(meta).encode())
    return meta


def prepare(texts: list[str | os.PathLike], out: str | os.PathLike) -> dict:
    """`interleaf data prepare`: tokenizes text files (bytes) into one token file."""
    parts = [encode(pathlib.Path(t).read_text(encoding="utf-8", errors="replace")) for t in texts]
    return write_tokens(out, np.concatenate(parts) if parts else np.zeros(0, np.uint16))


class TokenFile:
    """A read-only memory map over a token file."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        sidecar = _sidecar(self.path)
        if not self.path.is_file() or not sidecar.is_file():
            raise FileNotFoundError(
                f"data.source={str(path)!r}: no token file (and {sidecar.name}) there; "
                "write one with `interleaf data prepare`"
            )
        meta = json.loads(sidecar.read_text())
        self.sha256: str = meta["sha256"]
        if meta["tokens"] == 0 or self.path.stat().st_size == 0:
            raise ValueError(f"data.source={str(path)!r} holds no tokens")
        self.tokens = np.memmap(self.path, dtype=DTYPES[meta["dtype"]], mode="r")
        if self.tokens.size != meta["tokens"]:
            raise ValueError(
                f"data.source={str(path)!r} holds {self.tokens.size} tokens, its sidecar says {meta['tokens']}"
            )

    def __len__(self) -> int:
        return int(self.tokens.size)
