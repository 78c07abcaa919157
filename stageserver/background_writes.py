"""Checkpoint files written off the training thread.

A save takes the step's time only for copying the tensors out of the training buffers
(the caller hands over copies); the files are written by threads while training goes
on, and `finish` waits for them when the coordinator is ready to write the manifest,
which it writes only once every file is complete (coordinator/checkpoints.py).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from interleaf.stageserver import safetensors


@dataclass
class Written:
    path: str
    sha256: str
    bytes: int
    seconds: float


class BackgroundWrites:
    def __init__(self):
        self._pending: list[tuple[threading.Thread, dict]] = []

    def start(self, path: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> int:
        """Starts writing `tensors` (copies no training step touches) to `path`; returns
        their bytes."""
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        result: dict = {}

        def write():
            t0 = time.perf_counter()
            try:
                result["written"] = Written(path, safetensors.write(path, tensors, metadata), size,
                                            time.perf_counter() - t0)
            except BaseException as err:  # reported by finish, on the handler's thread
                result["error"] = err
        thread = threading.Thread(target=write, name=f"write {path}", daemon=True)
        thread.start()
        self._pending.append((thread, result))
        return size

    def finish(self) -> list[Written]:
        """Waits for every write started so far; raises the first that failed."""
        done = []
        pending, self._pending = self._pending, []
        for thread, result in pending:
            thread.join()
            if "error" in result:
                raise RuntimeError(f"writing {thread.name[6:]} failed: {result['error']}")
            done.append(result["written"])
        return done
