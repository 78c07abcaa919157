"""The safetensors file format, read and written without pickle or extra packages:
an 8-byte little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range (plus optional string metadata), then the raw tensor bytes."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import struct
import tempfile

import torch

_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}
_TORCH = {v: k for k, v in _DTYPES.items()}


def write(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """Writes atomically (temporary name, then rename); returns the file's SHA-256."""
    header, blobs, offset = {}, [], 0
    for name, tensor in tensors.items():
        data = tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    header["__metadata__"] = metadata
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (struct.pack("<Q", len(text)), text, *blobs):
                f.write(part)
                digest.update(part)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return digest.hexdigest()


def read(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    raw = pathlib.Path(path).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    metadata = header.pop("__metadata__", {})
    body = memoryview(raw)[8 + length :]
    tensors = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        flat = torch.frombuffer(bytearray(body[start:end]), dtype=_TORCH[info["dtype"]])
        tensors[name] = flat.reshape(info["shape"])
    return tensors, metadata
