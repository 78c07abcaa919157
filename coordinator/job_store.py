"""Job state on disk: the coordinator's SQLite database (`--state-db`), so that a
restarted coordinator knows every job it had, resumes those that were not final, and
never gives out a job id twice.

Kept per job: the config as submitted (TOML text and overrides), state, reason, error,
steps completed, the newest checkpoint's manifest, whether its cancel was asked for (a
coordinator that died before the job stopped ends it CANCELLED when started again,
rather than run it again), its newest MAX_STORED_EVENTS
events (what watchers replay after a restart) and its traced steps (`interleaf trace`;
trace.steps names at most 64). Each event is written as it is
published, with the job's row, in one transaction: WAL with synchronous=NORMAL commits
without an fsync each time and loses nothing when the process is killed (only an
operating system crash can lose the last commits).

One coordinator per database: a second one would resume the same jobs on other
servers, so opening takes an exclusive lock (PATH.lock), released by the kernel when
its holder dies however it dies.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import sqlite3
import threading
from dataclasses import dataclass, field

from interleaf.protos import interleaf_pb2 as pb

MEMORY = ":memory:"
"""A store that forgets everything with its process (coordinators made in tests)."""
MAX_STORED_EVENTS = 1000
"""Events kept per job, the newest: a long job's history stays bounded on disk."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    number INTEGER PRIMARY KEY,  -- the N of job-N-…: one more than any before, never reused
    job_id TEXT UNIQUE NOT NULL,
    config_toml TEXT NOT NULL,
    overrides TEXT NOT NULL,     -- JSON list of SECTION.KEY=VALUE
    state TEXT NOT NULL,
    reason TEXT NOT NULL DEFAULT '',
    error TEXT NOT NULL DEFAULT '',
    step INTEGER NOT NULL DEFAULT 0,
    checkpoint TEXT NOT NULL DEFAULT '',
    cancel_requested INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    event BLOB NOT NULL          -- a serialized JobEvent
);
CREATE INDEX IF NOT EXISTS events_by_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS traces (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    trace BLOB NOT NULL,         -- a serialized StepTrace, its traced_steps left empty
    PRIMARY KEY (job_id, step)
);
"""


class JobStoreError(RuntimeError):
    """The state database cannot be used; the message names --state-db."""


@dataclass
class StoredJob:
    job_id: str
    config_toml: str
    overrides: list[str]
    state: str
    reason: str
    error: str
    step: int
    checkpoint: str
    cancel_requested: bool = False
    events: list[pb.JobEvent] = field(default_factory=list)


def default_path() -> str:
    """--state-db's default: $XDG_STATE_HOME/interleaf/coordinator.db (~/.local/state/…)."""
    root = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(root, "interleaf", "coordinator.db")


class JobStore:
    def __init__(self, path: str = MEMORY):
        self.path = path
        self._lock = threading.Lock()
        self._held = None
        try:
            if path != MEMORY:
                pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._held = _lock_exclusively(path)
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            columns = {row[1] for row in self._db.execute("PRAGMA table_info(jobs)")}
            if "cancel_requested" not in columns:  # a database of an earlier release
                self._db.execute("ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0")
        except (OSError, sqlite3.Error) as err:
            raise JobStoreError(f"--state-db={path!r} cannot be used: {err}") from None

    def add(self, config_toml: str, overrides: list[str], make_id) -> str:
        """Records a new job, PENDING, under the id `make_id(N)` for the next N."""
        with self._lock, self._db:
            (number,) = self._db.execute("SELECT COALESCE(MAX(number), 0) + 1 FROM jobs").fetchone()
            job_id = make_id(number)
            self._db.execute("INSERT INTO jobs (number, job_id, config_toml, overrides, state) VALUES (?, ?, ?, ?, ?)",
                             (number, job_id, config_toml, json.dumps(list(overrides)), "PENDING"))
            return job_id

    def save(self, job_id: str, state: str, reason: str, error: str, step: int, checkpoint: str,
             event: pb.JobEvent) -> None:
        """The job's row as it is now and one more event; older events beyond the bound go.
        JobStoreError when the database refuses the write (a full disk)."""
        self._write(f"job {job_id}'s newest event ({state} at step {step})", [
            ("UPDATE jobs SET state=?, reason=?, error=?, step=?, checkpoint=? WHERE job_id=?",
             (state, reason, error, step, checkpoint, job_id)),
            ("INSERT INTO events (job_id, event) VALUES (?, ?)", (job_id, event.SerializeToString())),
            ("DELETE FROM events WHERE job_id=? AND id <= (SELECT id FROM events WHERE job_id=? "
             "ORDER BY id DESC LIMIT 1 OFFSET ?)", (job_id, job_id, MAX_STORED_EVENTS)),
        ])

    def save_trace(self, job_id: str, trace: pb.StepTrace) -> None:
        """A traced step; one run again after a recovery replaces the earlier run.
        JobStoreError when the database refuses the write."""
        self._write(f"job {job_id}'s trace of step {trace.step}", lambda: [
            ("INSERT OR REPLACE INTO traces (job_id, step, trace) VALUES (?, ?, ?)",
             (job_id, trace.step, trace.SerializeToString()))])

    def load_traces(self, job_id: str) -> list[pb.StepTrace]:
        """The job's traced steps, by step."""
        with self._lock:
            rows = self._db.execute("SELECT trace FROM traces WHERE job_id=? ORDER BY step", (job_id,)).fetchall()
        return [pb.StepTrace.FromString(blob) for (blob,) in rows]

    def request_cancel(self, job_id: str) -> None:
        """Records that the job's cancel was asked for, before it is answered."""
        self._write(f"job {job_id}'s cancel", [("UPDATE jobs SET cancel_requested=1 WHERE job_id=?", (job_id,))])

    def _write(self, what: str, statements) -> None:
        """Runs `statements` ((sql, parameters) pairs, or a function making them) in one
        transaction; JobStoreError naming `what` when the database refuses them (a full
        disk) or a value cannot be stored (a message over protobuf's or SQLite's 2 GiB)."""
        try:
            with self._lock, self._db:
                for sql, parameters in (statements() if callable(statements) else statements):
                    self._db.execute(sql, parameters)
        except (sqlite3.Error, OverflowError, ValueError) as err:
            raise JobStoreError(f"--state-db={self.path!r} could not store {what}: {err}") from None

    def load(self, job_id: str) -> StoredJob | None:
        with self._lock:
            row = self._db.execute("SELECT job_id, config_toml, overrides, state, reason, error, step, checkpoint, "
                                   "cancel_requested FROM jobs WHERE job_id=?", (job_id,)).fetchone()
            if row is None:
                return None
            events = self._db.execute("SELECT event FROM events WHERE job_id=? ORDER BY id", (job_id,)).fetchall()
        job = StoredJob(row[0], row[1], json.loads(row[2]), *row[3:8], cancel_requested=bool(row[8]))
        job.events = [pb.JobEvent.FromString(blob) for (blob,) in events]
        return job

    def unfinished(self, final_states: tuple[str, ...]) -> list[str]:
        """The ids of jobs not in a final state, oldest first."""
        marks = ", ".join("?" * len(final_states))
        with self._lock:
            rows = self._db.execute(f"SELECT job_id FROM jobs WHERE state NOT IN ({marks}) ORDER BY number",
                                    final_states).fetchall()
        return [job_id for (job_id,) in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._held is not None:
            self._held.close()


def _lock_exclusively(path: str):
    """Holds PATH.lock for this process's life (the kernel lets go when it dies)."""
    lock = open(f"{path}.lock", "a+")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "?"
        lock.close()
        raise JobStoreError(f"--state-db={path!r} is in use by another coordinator (pid {holder}): one "
                            f"coordinator per state database, or both would resume its jobs") from None
    lock.truncate(0)
    lock.write(str(os.getpid()))
    lock.flush()
    return lock
