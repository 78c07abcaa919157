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

Bounded (--keep-jobs): of the finished jobs, the newest `keep_jobs` to finish are kept;
older ones go with every row of theirs (events, traces) when a job finishes and when the
store opens, so the database holds at most keep_jobs finished jobs plus the unfinished
ones (never removed). Deleting rows does not shrink an SQLite file, so the database runs
with auto_vacuum=INCREMENTAL (an earlier release's file is converted once by a VACUUM
when opened) and each prune ends with incremental_vacuum, which hands the freed pages
back to the file system, and a WAL checkpoint that truncates the -wal file: the files'
size follows what is kept, not what was ever stored.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pathlib
import sqlite3
import threading
from dataclasses import dataclass, field

from interleaf.protos import interleaf_pb2 as pb
from interleaf.protos.job_states import FINAL_STATES

log = logging.getLogger("interleaf.coordinator")

MEMORY = ":memory:"
"""A store that forgets everything with its process (coordinators made in tests)."""
MAX_STORED_EVENTS = 1000
"""Events kept per job, the newest: a long job's history stays bounded on disk."""
DEFAULT_KEEP_JOBS = 1000
"""--keep-jobs' default: finished jobs kept, the newest to finish."""

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
    cancel_requested INTEGER NOT NULL DEFAULT 0,
    finished INTEGER             -- the order it reached a final state in (1, 2, ...); NULL while unfinished
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
CREATE TABLE IF NOT EXISTS counters (
    name TEXT PRIMARY KEY,       -- last_job_number: the highest N given out, pruned jobs' included
    value INTEGER NOT NULL
);
"""
_FINAL = ", ".join(f"'{state}'" for state in FINAL_STATES)


class JobStoreError(RuntimeError):
    """The state database cannot be used; the message names the flag at fault
    (--state-db, --keep-jobs)."""


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
    def __init__(self, path: str = MEMORY, keep_jobs: int = DEFAULT_KEEP_JOBS):
        if keep_jobs < 1:  # refused before the file is touched
            raise JobStoreError(f"--keep-jobs={keep_jobs} must be at least 1: the newest job to finish stays in "
                                f"the state database so that its client can still read how it ended")
        self.path = path
        self.keep_jobs = keep_jobs
        self._lock = threading.Lock()
        self._held = None
        try:
            if path != MEMORY:
                pathlib.Path(path).parent.mkdir(parents=True, exist_ok=True)
                self._held = _lock_exclusively(path)
            self._db = sqlite3.connect(path, check_same_thread=False)
            converting = _vacuum_incrementally(self._db)  # before the tables: a new file is made so from the start
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self._db.executescript(_SCHEMA)
            _upgrade(self._db)
            self.prune()  # a smaller --keep-jobs than the last coordinator's takes effect now
            if converting:  # after the prune: the VACUUM rewrites only what is kept
                log.info("--state-db=%r: converting to auto_vacuum=INCREMENTAL (one VACUUM)", path)
                self._db.execute("VACUUM")
                self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()  # the rewrite went to the WAL
        except (OSError, sqlite3.Error) as err:
            raise JobStoreError(f"--state-db={path!r} cannot be used: {err}") from None

    def add(self, config_toml: str, overrides: list[str], make_id) -> str:
        """Records a new job, PENDING, under the id `make_id(N)` for the next N. N counts
        past pruned jobs too (counters.last_job_number): an id is never given out twice."""
        with self._lock, self._db:
            (number,) = self._db.execute(
                "SELECT MAX(COALESCE((SELECT MAX(number) FROM jobs), 0), "
                "COALESCE((SELECT value FROM counters WHERE name='last_job_number'), 0)) + 1").fetchone()
            job_id = make_id(number)
            self._db.execute("INSERT INTO jobs (number, job_id, config_toml, overrides, state) VALUES (?, ?, ?, ?, ?)",
                             (number, job_id, config_toml, json.dumps(list(overrides)), "PENDING"))
            self._db.execute("INSERT OR REPLACE INTO counters (name, value) VALUES ('last_job_number', ?)", (number,))
            return job_id

    def save(self, job_id: str, state: str, reason: str, error: str, step: int, checkpoint: str,
             event: pb.JobEvent) -> None:
        """The job's row as it is now and one more event; older events beyond the bound go.
        A job reaching a final state takes the next `finished` number (the order prune
        keeps by). JobStoreError when the database refuses the write (a full disk)."""
        self._write(f"job {job_id}'s newest event ({state} at step {step})", [
            ("UPDATE jobs SET state=?, reason=?, error=?, step=?, checkpoint=?, finished=CASE WHEN ? AND finished "
             "IS NULL THEN (SELECT COALESCE(MAX(finished), 0) + 1 FROM jobs) ELSE finished END WHERE job_id=?",
             (state, reason, error, step, checkpoint, state in FINAL_STATES, job_id)),
            # Only while the job has its row: a pruned job's late event must not leave rows no prune finds.
            ("INSERT INTO events (job_id, event) SELECT ?, ? WHERE EXISTS (SELECT 1 FROM jobs WHERE job_id=?)",
             (job_id, event.SerializeToString(), job_id)),
            ("DELETE FROM events WHERE job_id=? AND id <= (SELECT id FROM events WHERE job_id=? "
             "ORDER BY id DESC LIMIT 1 OFFSET ?)", (job_id, job_id, MAX_STORED_EVENTS)),
        ])

    def save_trace(self, job_id: str, trace: pb.StepTrace) -> None:
        """A traced step; one run again after a recovery replaces the earlier run.
        JobStoreError when the database refuses the write."""
        self._write(f"job {job_id}'s trace of step {trace.step}", lambda: [
            ("INSERT OR REPLACE INTO traces (job_id, step, trace) SELECT ?, ?, ? WHERE EXISTS "
             "(SELECT 1 FROM jobs WHERE job_id=?)", (job_id, trace.step, trace.SerializeToString(), job_id))])

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

    def prune(self) -> list[str]:
        """Removes the finished jobs beyond the newest `keep_jobs` to finish, with their
        events and traces, and gives the freed pages back to the file system; returns
        their ids, oldest first. Cheap when a job finishes: one job goes, found through
        the index on `finished`. A failure is logged: the jobs stay, for the next prune."""
        try:
            with self._lock:
                with self._db:
                    gone = [job_id for (job_id,) in self._db.execute(
                        "SELECT job_id FROM jobs WHERE finished IS NOT NULL ORDER BY finished DESC LIMIT -1 OFFSET ?",
                        (self.keep_jobs,))][::-1]
                    for job_id in gone:
                        for table in ("events", "traces", "jobs"):
                            self._db.execute(f"DELETE FROM {table} WHERE job_id=?", (job_id,))
                if gone:
                    self._shrink()
        except sqlite3.Error as err:
            log.error("--state-db=%r: pruning finished jobs beyond --keep-jobs=%d failed: %s", self.path,
                      self.keep_jobs, err)
            return []
        if gone:
            log.info("removed %d finished job(s) beyond --keep-jobs=%d from %s: %s", len(gone), self.keep_jobs,
                     self.path, ", ".join(gone))
        return gone

    def _shrink(self) -> None:
        """The free pages go back to the file system, and the -wal file is emptied. Each
        step of incremental_vacuum frees one page, and sqlite3's execute stops a statement
        that returns no rows after its first step (fetchall does not go on with it), so it
        runs as a script, which steps each statement to its end. The checkpoint writes the
        WAL into the database, whose truncation happens only then."""
        self._db.executescript("PRAGMA incremental_vacuum;")
        self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._held is not None:
            self._held.close()


def _vacuum_incrementally(db: sqlite3.Connection) -> bool:
    """auto_vacuum=INCREMENTAL: takes effect on a new file at its first table; an
    earlier release's file (auto_vacuum NONE) takes it at its next VACUUM, which rewrites
    it whole: True when that VACUUM is still to run."""
    (mode,) = db.execute("PRAGMA auto_vacuum").fetchone()
    if mode == 2:  # INCREMENTAL
        return False
    db.execute("PRAGMA auto_vacuum=INCREMENTAL")
    (pages,) = db.execute("PRAGMA page_count").fetchone()
    return pages > 0


def _upgrade(db: sqlite3.Connection) -> None:
    """Columns an earlier release's database lacks. Its finished jobs are numbered in
    the order they were submitted (when each finished was not recorded)."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(jobs)")}
    with db:
        if "cancel_requested" not in columns:
            db.execute("ALTER TABLE jobs ADD COLUMN cancel_requested INTEGER NOT NULL DEFAULT 0")
        if "finished" not in columns:
            db.execute("ALTER TABLE jobs ADD COLUMN finished INTEGER")
            db.execute(f"UPDATE jobs SET finished=number WHERE state IN ({_FINAL})")
        db.execute("CREATE INDEX IF NOT EXISTS jobs_by_finished ON jobs (finished)")


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
