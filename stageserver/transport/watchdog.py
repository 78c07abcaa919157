"""Aborts communication that overruns its deadline.

NCCL has no timeout of its own: an operation whose peer never arrives spins on the GPU
forever, and a host thread that then synchronizes hangs with it. The watchdog polls
every operation in flight (anything with `is_completed()`); one still unfinished
`timeout_s` after it started gets its group aborted through `on_overrun`, which makes
the GPU kernels return. An operation that can say when it started (`is_started()`: a
GPU operation queued behind a step's compute starts long after the host issued it) is
timed from then, any other from when it was issued. The failure is kept for the
executor to raise at the step's end, so the coordinator hears which group and operation
overran. gloo has timeouts of its own; the watchdog works the same over its works,
which is how it is tested without a GPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Overrun(RuntimeError):
    pass


class Watchdog:
    def __init__(self, name: str, timeout_s: float, on_overrun: Callable[[], None], poll_s: float = 0.1):
        self.name = name
        self.timeout_s = timeout_s
        self.on_overrun = on_overrun
        self.poll_s = poll_s
        self.failure: Overrun | None = None
        self._pending: list[list] = []  # [deadline (None until started), what, work]
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"watchdog-{name}", daemon=True)
        self._thread.start()

    def watch(self, work, what: str):
        """Tracks `work` (returned as is) until it completes or overruns."""
        with self._lock:
            self._pending.append([None, what, work])
        return work

    def check(self) -> None:
        """Raises the overrun, if one happened."""
        if self.failure is not None:
            raise self.failure

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            now = time.monotonic()
            with self._lock:
                self._pending = [p for p in self._pending if not p[2].is_completed()]
                for p in self._pending:
                    if p[0] is None and getattr(p[2], "is_started", lambda: True)():
                        p[0] = now + self.timeout_s
                late = next((p for p in self._pending if p[0] is not None and p[0] <= now), None)
            if late is not None and self.failure is None:
                self.failure = Overrun(f"group {self.name}: {late[1]} did not finish within "
                                       f"{self.timeout_s:g} s; the group was aborted")
                try:
                    self.on_overrun()
                finally:
                    with self._lock:
                        self._pending.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
