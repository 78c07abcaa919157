"""Token files: a flat array of uint16 or uint32 token ids, read through a memory map,
with a small JSON sidecar (`NAME.json`) recording what they are, so every stage server
can prove it reads the same tokens and the coordinator can check they fit the model:

  dtype, count, sha256      the array itself
  documents                 how many documents it concatenates
  vocab_size, eos_id        the tokenizer's vocabulary and end-of-document id (or null)
  tokenizer                 the tokenizer's fingerprint (common/data/text_tokenizer.py)

Sidecars written before `count` was named `tokens` (and recorded only the first three
fields) are still read.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np

from interleaf.common.data.token_sidecar import DTYPES, read_sidecar, token_count
from interleaf.common.durable import temporary_beside

def _sidecar(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(path.name + ".json")


def _atomic_write(path: pathlib.Path, data: bytes) -> None:
    """Written under a temporary name and renamed, so a reader never sees half a file."""
    fd, tmp = temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def dtype_for(vocab_size: int) -> str:
    """The smaller dtype that holds every id of a vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


class TokenWriter:
    """Streams token ids into a token file: they go to a temporary file beside it,
    hashed as they are written, renamed into place once complete, and the sidecar is
    written last. A reader (another local server building the same cache) thus sees the
    old file or the whole new one, and a failed write (an exception inside the `with`)
    leaves nothing behind and the old file as it was."""

    def __init__(self, path: str | os.PathLike, dtype: str):
        self.path = pathlib.Path(path)
        self.dtype = DTYPES[dtype]
        self.count = 0
        self._sha = hashlib.sha256()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = temporary_beside(self.path)
        self._file = os.fdopen(fd, "wb")

    def __enter__(self) -> "TokenWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if not self._file.closed:
            self._file.close()
        if kind is not None and os.path.exists(self._tmp):
            os.unlink(self._tmp)

    def write(self, ids: np.ndarray) -> None:
        ids = np.asarray(ids)
        # A cast would wrap an id that does not fit silently: refuse it instead.
        if ids.size and int(ids.max()) > np.iinfo(self.dtype).max:
            raise ValueError(f"token id {int(ids.max())} does not fit this file's {np.dtype(self.dtype).name}: "
                             f"the tokenizer's vocabulary is smaller than its ids")
        data = np.ascontiguousarray(ids, dtype=self.dtype).tobytes()
        self._file.write(data)
        self._sha.update(data)
        self.count += len(data) // self.dtype().itemsize

    def finish(self, **described) -> dict:
        """Puts the file in place and writes its sidecar: dtype, count, sha256 and
        `described` (documents, vocab_size, eos_id, tokenizer); returns the sidecar."""
        self._file.close()
        meta = {"dtype": np.dtype(self.dtype).name, "count": self.count, "sha256": self._sha.hexdigest(), **described}
        os.replace(self._tmp, self.path)
        _atomic_write(_sidecar(self.path), json.dumps(meta, indent=1).encode())
        return meta


def write_tokens(path: str | os.PathLike, tokens: np.ndarray, **described) -> dict:
    """Writes `tokens` as the smallest dtype that holds them; returns the sidecar."""
    tokens = np.asarray(tokens)
    with TokenWriter(path, dtype_for(int(tokens.max()) + 1 if tokens.size else 0)) as writer:
        writer.write(tokens)
        return writer.finish(**described)


class TokenFile:
    """A read-only memory map over a token file."""

    def __init__(self, path: str | os.PathLike, field: str = "data.source"):
        """`field`: the setting that named the file, for the errors (data.source, eval.source)."""
        self.path = pathlib.Path(path)
        sidecar = _sidecar(self.path)
        if not self.path.is_file() or not sidecar.is_file():
            raise FileNotFoundError(
                f"{field}={str(path)!r}: no token file (and {sidecar.name}) there; "
                "write one with `interleaf data prepare`"
            )
        try:
            self.meta: dict = read_sidecar(sidecar)
        except ValueError as err:
            raise ValueError(f"{field}={str(path)!r}: its sidecar {sidecar.name} is not one `interleaf data "
                             f"prepare` writes ({err})") from None
        self.sha256: str = self.meta["sha256"]
        count = token_count(self.meta)
        dtype = DTYPES[self.meta["dtype"]]
        if count == 0 or self.path.stat().st_size == 0:
            raise ValueError(f"{field}={str(path)!r} holds no tokens")
        self.tokens = np.memmap(self.path, dtype=dtype, mode="r")
        if self.tokens.size != count:
            raise ValueError(
                f"{field}={str(path)!r} holds {self.tokens.size} tokens, its sidecar says {count}"
            )
        # None for a file whose sidecar predates the field: then only its ids are checked.
        self.vocab_size: int | None = self.meta.get("vocab_size")

    def __len__(self) -> int:
        return int(self.tokens.size)
