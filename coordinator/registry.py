"""The stage servers the coordinator knows: registration, heartbeats, who is free.

A server that stops heartbeating is DEAD after DEAD_AFTER_S and, holding no job, is
forgotten FORGET_DEAD_AFTER_S later: shown as DEAD meanwhile (status page, metrics),
then gone, so servers that come and go (a new address each restart, as in Kubernetes)
leave no growing list behind. One that comes back after that registers afresh.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

from interleaf.coordinator.plan import ServerSlot

HEARTBEAT_INTERVAL_S = 1.0
DEAD_AFTER_S = 5 * HEARTBEAT_INTERVAL_S
FORGET_DEAD_AFTER_S = 300.0
"""How long a DEAD server with no job stays listed: long enough to be seen on the status
page and in a few scrapes. One holding a job stays until its driver forgets it."""


@dataclass
class ServerEntry:
    server_id: str
    address: str
    host: str
    device: str
    memory_bytes: int
    last_seen: float
    job_id: str = ""
    metrics_port: int = 0  # its Prometheus endpoint, on the host of `address`
    peak_flops: float = 0.0
    longest_gap: float = 0.0  # between two heartbeats (or registration and the first)

    @property
    def heartbeat_age(self) -> float:
        """Seconds since the coordinator last heard from the server."""
        return time.monotonic() - self.last_seen

    @property
    def heartbeat_gap_max(self) -> float:
        """The longest the server went unheard since it registered, the current silence
        included."""
        return max(self.longest_gap, self.heartbeat_age)

    @property
    def alive(self) -> bool:
        return time.monotonic() - self.last_seen < DEAD_AFTER_S

    @property
    def state(self) -> str:
        if not self.alive:
            return "DEAD"
        return "BUSY" if self.job_id else "IDLE"

    def slot(self) -> ServerSlot:
        return ServerSlot(self.server_id, self.address, self.host, self.memory_bytes, self.device)


class Registry:
    def __init__(self):
        self._lock = threading.Lock()
        self._servers: dict[str, ServerEntry] = {}
        # Jobs whose last claim found too few servers, until one succeeds or the job
        # releases: an elastic job's growth yields to them (claim(own=True)).
        self._waiting: set[str] = set()
        self.changed = threading.Condition(self._lock)

    def register(self, address: str, host: str, device: str, memory_bytes: int, metrics_port: int = 0,
                 peak_flops: float = 0.0) -> str:
        with self._lock:
            self._forget_long_dead()
            # A server that restarts on the same address replaces its old entry.
            for sid, entry in list(self._servers.items()):
                if entry.address == address and not entry.job_id:
                    del self._servers[sid]
            server_id = f"s-{uuid.uuid4().hex[:8]}"
            self._servers[server_id] = ServerEntry(
                server_id, address, host or address.rsplit(":", 1)[0], device, memory_bytes, time.monotonic(),
                metrics_port=metrics_port, peak_flops=peak_flops,
            )
            self.changed.notify_all()
            return server_id

    def heartbeat(self, server_id: str) -> bool:
        with self._lock:
            entry = self._servers.get(server_id)
            if entry is None:
                return False
            now = time.monotonic()
            entry.longest_gap = max(entry.longest_gap, now - entry.last_seen)
            entry.last_seen = now
            return True

    def servers(self) -> list[ServerEntry]:
        with self._lock:
            self._forget_long_dead()
            return sorted(self._servers.values(), key=lambda e: e.address)

    def _forget_long_dead(self) -> None:
        """Under the lock. Done whenever servers are listed or one registers: nothing else
        grows the table or shows it."""
        forgotten = time.monotonic() - (DEAD_AFTER_S + FORGET_DEAD_AFTER_S)
        for sid, entry in list(self._servers.items()):
            if not entry.job_id and entry.last_seen < forgotten:
                del self._servers[sid]

    def claim(self, job_id: str, choose, timeout_s: float, own: bool = False) -> list[ServerSlot] | None:
        """Waits until `choose(idle servers)` picks some, marks exactly those busy for
        the job and returns them in the order chosen; None on timeout. `choose` returns
        None while the idle servers cannot host the job. `own`: the job's own live servers
        are offered beside the idle ones (an elastic job growing back keeps its servers);
        a server of another job never is. Those of its own not chosen stay the job's
        until `release(job_id, keep=...)`: they still hold its running attempt. A job
        that grows is running already, so it yields to any job waiting for servers: a
        queued job is never kept waiting by another's growth."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                if own and self._waiting - {job_id}:
                    return None
                idle = sorted((e for e in self._servers.values()
                               if e.alive and (not e.job_id or (own and e.job_id == job_id))),
                              key=lambda e: e.address)
                chosen = choose([e.slot() for e in idle])
                if chosen is not None:
                    for slot in chosen:
                        self._servers[slot.server_id].job_id = job_id
                    self._waiting.discard(job_id)
                    return chosen
                if not own:
                    self._waiting.add(job_id)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self.changed.wait(min(remaining, HEARTBEAT_INTERVAL_S))

    def silence(self, server_id: str) -> float | None:
        """Seconds since the server's last heartbeat; None once it is forgotten."""
        with self._lock:
            entry = self._servers.get(server_id)
            return None if entry is None else time.monotonic() - entry.last_seen

    def forget(self, server_ids: list[str]) -> None:
        """Drops servers declared dead: never claimed again; one that was alive after
        all hears NOT_FOUND at its next heartbeat and registers afresh, without a job."""
        with self._lock:
            for server_id in server_ids:
                self._servers.pop(server_id, None)
            self.changed.notify_all()

    def release(self, job_id: str, keep: frozenset[str] = frozenset()) -> None:
        """Frees the job's servers, but those whose server_id is in `keep`; the job no
        longer waits for any."""
        with self._lock:
            self._waiting.discard(job_id)
            for entry in self._servers.values():
                if entry.job_id == job_id and entry.server_id not in keep:
                    entry.job_id = ""
            self.changed.notify_all()
