"""The coordinator's job state in SQLite (coordinator/job_store.py), with no processes:
what a restarted coordinator reads back (traced steps included), ids that never repeat,
the bound on stored events, and the lock that keeps a second coordinator off the same
database."""

from __future__ import annotations

import os

import pytest

from interleaf.coordinator.config import load_config
from interleaf.coordinator.job_store import MAX_STORED_EVENTS, JobStore, JobStoreError
from interleaf.coordinator.jobs import JobTable
from interleaf.coordinator.service import CoordinatorService
from interleaf.protos import interleaf_pb2 as pb

SETTINGS = ["train.steps=5", "parallel.microbatches=2"]


def test_a_job_reads_back_as_it_was_and_ids_never_repeat(tmp_path):
    path = str(tmp_path / "state.db")
    store = JobStore(path)
    table = JobTable(store)
    first = table.create(load_config("", SETTINGS), "", SETTINGS)
    first.set_state("RUNNING")
    first.add_step(pb.StepEvent(step=0, loss=5.5))
    first.checkpoint = "/ckpt/step-000001/manifest.json"
    first.add_checkpoint(pb.CheckpointEvent(kind="saved", step=1, manifest=first.checkpoint))
    done = table.create(load_config("", SETTINGS), "", SETTINGS)
    done.set_state("SUCCEEDED")
    store.close()

    table = JobTable(JobStore(path))
    (again,) = table.unfinished()
    assert (again.job_id, again.state, again.step, again.checkpoint) == (first.job_id, "RUNNING", 1,
                                                                         first.checkpoint)
    assert again.config == load_config("", SETTINGS) and again.last.loss == 5.5
    assert [e.WhichOneof("event") for e in again.events] == ["status", "step", "checkpoint"]
    assert table.get(done.job_id).state == "SUCCEEDED"  # read when asked for
    numbers = [int(job_id.split("-")[1]) for job_id in (first.job_id, done.job_id,
                                                        table.create(load_config("", SETTINGS)).job_id)]
    assert numbers == [1, 2, 3]


def test_stored_events_are_bounded_to_the_newest(tmp_path):
    path = str(tmp_path / "state.db")
    store = JobStore(path)
    record = JobTable(store).create(load_config("", SETTINGS))
    for step in range(MAX_STORED_EVENTS + 50):
        record.add_step(pb.StepEvent(step=step))
    store.close()
    (again,) = JobTable(JobStore(path)).unfinished()
    assert [e.step.step for e in again.events] == list(range(50, MAX_STORED_EVENTS + 50))
    assert again.step == MAX_STORED_EVENTS + 50


def test_one_coordinator_per_state_db(tmp_path):
    path = str(tmp_path / "state.db")
    held = JobStore(path)
    with pytest.raises(JobStoreError, match=r"--state-db='.*state.db' is in use by another coordinator \(pid \d+\)"):
        JobStore(path)
    held.close()
    JobStore(path).close()  # free once its holder let go


def test_a_job_whose_config_no_longer_loads_fails_by_name(tmp_path):
    store = JobStore(str(tmp_path / "state.db"))
    record = JobTable(store).create(load_config("", SETTINGS), "", ["train.steps=-1"])  # as a stricter rule sees it
    record.set_state("RUNNING")
    service = CoordinatorService(("127.0.0.1", 0), job_store=store)
    service.resume_jobs()
    final = service.jobs.get(record.job_id)
    assert final.state == "FAILED" and not service.drivers
    assert final.error.startswith("its config no longer loads after the coordinator restarted: train.steps=-1")


def test_a_cancel_asked_for_before_the_coordinator_died_ends_the_job_cancelled(tmp_path):
    path = str(tmp_path / "state.db")
    store = JobStore(path)
    record = JobTable(store).create(load_config("", SETTINGS), "", SETTINGS)
    record.set_state("RUNNING")
    record.request_cancel()  # CancelJob answered; the coordinator dies before the job is CANCELLED
    store.close()

    service = CoordinatorService(("127.0.0.1", 0), job_store=JobStore(path))
    service.resume_jobs()
    final = service.jobs.get(record.job_id)
    assert final.state == "CANCELLED" and not service.drivers
    assert final.reason == "cancelled before the coordinator stopped; recorded after the restart"


def test_a_full_disk_is_logged_and_the_job_and_its_watchers_go_on(tmp_path, caplog):
    store = JobStore(str(tmp_path / "state.db"))
    record = JobTable(store).create(load_config("", SETTINGS))
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here on
    watcher = record.follow(poll_s=60)  # would wait a minute for an event not notified
    for step in range(20):
        record.add_step(pb.StepEvent(step=step, ranks=[pb.RankMemory(rank=r) for r in range(64)]))
    assert record.step == 20 and [e.step.step for e in record.events] == list(range(20))
    assert "could not store job" in caplog.text and "database or disk is full" in caplog.text
    record.set_state("SUCCEEDED")
    assert [e.WhichOneof("event") for e in watcher] == ["step"] * 20 + ["status"]


def _traced(step: int, step_seconds: float) -> tuple[pb.StepTrace, list[pb.StepReport]]:
    plan = pb.StepTrace(job_id="j", programs=[pb.PipelineProgram(pipeline_rank=0, actions=[pb.Action(text="F0.0")])],
                        grid=pb.Coordinates(dp=1, pp=1, tp=1), schedule="1f1b", vpp=1, microbatches=1)
    reports = [pb.StepReport(step=step, rank=r, step_seconds=step_seconds,
                             spans=[pb.ActionSpan(action="F0.0", kind="forward", end_seconds=step_seconds)])
               for r in (1, 0)]
    return plan, reports


def test_traced_steps_are_served_after_a_restart(tmp_path):
    path = str(tmp_path / "state.db")
    store = JobStore(path)
    record = JobTable(store).create(load_config("", SETTINGS))
    for step, seconds in [(1, 0.5), (4, 0.25), (1, 0.75)]:  # step 1 run again after a recovery
        record.traces.add(*_traced(step, seconds))
    before = {step: record.traces.get(step) for step in (1, 4)}
    store.close()

    again = JobTable(JobStore(path)).get(record.job_id)
    assert again.traces.steps() == [1, 4]
    for step in (1, 4):
        assert again.traces.get(step) == before[step]
    assert [r.rank for r in again.traces.get(1).reports] == [0, 1]
    assert again.traces.get(1).reports[0].step_seconds == 0.75  # the later run of step 1
    assert list(again.traces.get().traced_steps) == [1, 4]  # the newest, with every step traced


def test_a_trace_the_store_refuses_is_served_from_memory(tmp_path, caplog):
    store = JobStore(str(tmp_path / "state.db"))
    record = JobTable(store).create(load_config("", SETTINGS))
    (pages,) = store._db.execute("PRAGMA page_count").fetchone()
    store._db.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full from here on
    plan, _ = _traced(2, 0.5)
    reports = [pb.StepReport(step=2, rank=r, spans=[pb.ActionSpan(action="F0.0", kind="forward")] * 2000)
               for r in range(8)]  # more than the free space left on the database's pages
    record.traces.add(plan, reports)
    assert "could not store job" in caplog.text and "trace of step 2" in caplog.text
    assert record.traces.steps() == [2] and len(record.traces.get(2).reports) == 8


def _finished(table: JobTable, state: str = "SUCCEEDED"):
    """A job with a trace and a final state (its one event)."""
    record = table.create(load_config("", SETTINGS), "", SETTINGS)
    record.traces.add(*_traced(1, 0.5))
    record.set_state(state)
    return record


def _rows(store: JobStore) -> dict[str, int]:
    return {table: store._db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
            for table in ("jobs", "events", "traces")}


def test_finished_jobs_beyond_keep_jobs_go_with_every_row_of_theirs(tmp_path):
    path = str(tmp_path / "state.db")
    store = JobStore(path, keep_jobs=2)
    table = JobTable(store)
    forgotten = []
    table.on_pruned(forgotten.extend)
    running = table.create(load_config("", SETTINGS), "", SETTINGS)  # the oldest, never finished: it stays
    running.set_state("RUNNING")
    done = [_finished(table, state) for state in ("SUCCEEDED", "FAILED", "CANCELLED", "SUCCEEDED")]
    assert forgotten == [done[0].job_id, done[1].job_id]
    for gone in done[:2]:
        assert table.get(gone.job_id) is None and store.load(gone.job_id) is None and not store.load_traces(gone.job_id)
    assert [table.get(kept.job_id).state for kept in done[2:]] == ["CANCELLED", "SUCCEEDED"]
    assert table.get(running.job_id).state == "RUNNING"
    # the running job's event (RUNNING), one for each kept one (its final state); a trace each
    assert _rows(store) == {"jobs": 3, "events": 1 + 1 + 1, "traces": 2}
    store.close()

    table = JobTable(JobStore(path, keep_jobs=2))
    assert int(table.create(load_config("", SETTINGS)).job_id.split("-")[1]) == 6  # numbers are never reused


def test_the_newest_to_finish_are_kept_not_the_newest_submitted(tmp_path):
    table = JobTable(JobStore(str(tmp_path / "state.db"), keep_jobs=1))
    long_job = table.create(load_config("", SETTINGS))
    short = _finished(table)
    long_job.set_state("SUCCEEDED")  # finishes last: its client reads it, the short one goes
    assert table.get(short.job_id) is None and table.get(long_job.job_id).state == "SUCCEEDED"
    assert table.create(load_config("", SETTINGS)).job_id.startswith("job-3-")  # job-2 was pruned: 3, not 2 again


def test_a_smaller_keep_jobs_prunes_when_the_store_opens(tmp_path):
    path = str(tmp_path / "state.db")
    table = JobTable(JobStore(path, keep_jobs=10))
    done = [_finished(table) for _ in range(4)]
    table.store.close()
    store = JobStore(path, keep_jobs=1)
    assert [store.load(r.job_id) is not None for r in done] == [False, False, False, True]


def test_a_prune_gives_every_freed_page_back_to_the_file_system(tmp_path):
    path = str(tmp_path / "state.db")
    table = JobTable(JobStore(path, keep_jobs=10))
    plan, _ = _traced(2, 0.5)
    for _ in range(4):  # jobs of about 400 KB each: their traces' spans
        record = table.create(load_config("", SETTINGS), "", SETTINGS)
        record.traces.add(plan, [pb.StepReport(step=2, rank=r, spans=[pb.ActionSpan(action="F0.0", kind="forward")]
                                               * 2000) for r in range(8)])
        record.set_state("SUCCEEDED")
    table.store.close()
    before = os.path.getsize(path)
    store = JobStore(path, keep_jobs=1)  # three of four go at open
    assert store._db.execute("PRAGMA freelist_count").fetchone()[0] == 0
    assert os.path.getsize(path) < before / 2, (before, os.path.getsize(path))
    store.close()


def test_keep_jobs_below_one_is_refused_by_name(tmp_path):
    with pytest.raises(JobStoreError, match=r"^--keep-jobs=0 must be at least 1: the newest job to finish stays"):
        JobStore(str(tmp_path / "state.db"), keep_jobs=0)
    assert not (tmp_path / "state.db").exists()


def test_an_earlier_releases_database_is_converted_and_pruned(tmp_path):
    """auto_vacuum NONE, no `finished` column: pruned, then made incremental by one
    VACUUM that gives the pruned rows' space back; its finished jobs are numbered in
    submission order."""
    import os
    import sqlite3

    path = str(tmp_path / "state.db")
    old = sqlite3.connect(path)
    old.executescript("""
        CREATE TABLE jobs (number INTEGER PRIMARY KEY, job_id TEXT UNIQUE NOT NULL, config_toml TEXT NOT NULL,
            overrides TEXT NOT NULL, state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '',
            error TEXT NOT NULL DEFAULT '', step INTEGER NOT NULL DEFAULT 0, checkpoint TEXT NOT NULL DEFAULT '');
        CREATE TABLE events (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, event BLOB NOT NULL);
        INSERT INTO jobs (number, job_id, config_toml, overrides, state) VALUES
            (1, 'job-1-x', '', '[]', 'SUCCEEDED'), (2, 'job-2-x', '', '[]', 'RUNNING'), (3, 'job-3-x', '', '[]', 'FAILED');
        INSERT INTO events (job_id, event) VALUES ('job-1-x', randomblob(2000000)), ('job-3-x', x'');
    """)
    old.commit()
    old.close()
    assert os.path.getsize(path) > 2_000_000
    store = JobStore(path, keep_jobs=1)
    assert sum(os.path.getsize(p) for p in (path, f"{path}-wal")) < 100_000
    assert store._db.execute("PRAGMA auto_vacuum").fetchone() == (2,)  # INCREMENTAL
    assert [store.load(j) is not None for j in ("job-1-x", "job-2-x", "job-3-x")] == [False, True, True]
    assert _rows(store)["events"] == 1
