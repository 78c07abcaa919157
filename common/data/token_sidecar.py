"""A token file's sidecar (`data.bin.json`, written by `interleaf data prepare`:
stageserver/data/tokenfile.py) read and checked, shared by the stage servers that open
the file, `interleaf data inspect` and the vocabulary check at submission
(common/data/vocab_check.py)."""

from __future__ import annotations

import json
import pathlib

import numpy as np

DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def read_sidecar(sidecar: pathlib.Path) -> dict:
    """A token file's sidecar, read from the path `sidecar` and checked to be an object
    holding what a reader of the file needs: dtype (one of DTYPES), count (or an old
    sidecar's tokens) and sha256. Raises OSError when it cannot be read, else ValueError
    saying what is wrong with it."""
    meta = json.loads(sidecar.read_text())  # JSONDecodeError is a ValueError
    if not isinstance(meta, dict):
        raise ValueError(f"it holds a JSON {type(meta).__name__}, not an object of dtype, count and sha256")
    missing = [key for key in ("dtype", "count", "sha256")
               if key not in meta and not (key == "count" and "tokens" in meta)]
    if missing:
        raise ValueError(f"it lacks {', '.join(missing)}")
    if not isinstance(meta["dtype"], str) or meta["dtype"] not in DTYPES:
        raise ValueError(f"its dtype {meta['dtype']!r} is not one of {', '.join(DTYPES)}")
    count = token_count(meta)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"its count {count!r} is not a number of tokens")
    return meta


def token_count(meta: dict) -> int:
    """The tokens a sidecar says its file holds: `count`, or an older sidecar's `tokens`."""
    return meta["count"] if "count" in meta else meta["tokens"]
