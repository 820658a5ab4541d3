"""The analysis worker among several collector processes: a database error does not stop it, a
holder that lost the lease mid-cycle writes nothing more, a run deleted mid-cycle leaves nothing
behind, and a holder that takes the lease again reads its runs afresh."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import func, select, text, update
from sqlalchemy.exc import OperationalError

from trainvitals.service.analysis import pipeline
from trainvitals.service.analysis.worker import AnalysisWorker
from trainvitals.service.ingest.replay import replay_files
from trainvitals.service.settings import Settings
from trainvitals.service.store import analysis_status, batches, db, queries
from trainvitals.service.store.lease import AnalysisLease
from trainvitals.service.store.models import Base, FindingRow, ReductionState, StepRow, StepSummary
from trainvitals.wire import Batch, RunRegistration

NOW = 10_000.0


@pytest.fixture
def maker(db_url: str):
    engine = db.make_engine(db_url)
    yield db.make_sessionmaker(engine)
    engine.dispose()


def _store(maker, run: str, *, steps: int = 20) -> None:
    with maker() as session:
        batches.register_run(
            session, RunRegistration(run=run, parallelism={"world_size": 1}, hardware={"gpu_count": 1}), now=NOW
        )
        records = [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0, "loss": 2.0} for s in range(steps)]
        if records:
            body = {"run": run, "rank": 0, "incarnation": 1, "seq": 1, "records": records}
            batches.store_batch(session, Batch.model_validate(body), now=NOW)


def _wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def _summarised(maker, run: str) -> int:
    with maker() as session:
        return int(session.scalar(select(func.count()).select_from(StepSummary).where(StepSummary.run_id == run)) or 0)


def test_a_database_error_outside_any_run_does_not_stop_the_analysis(
    maker, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The first session cannot connect (the database restarting): the cycle fails, is logged in
    one line and counted, and a later cycle analyses the run."""
    _store(maker, "r")
    calls = [0]

    def flaky():
        calls[0] += 1
        if calls[0] == 1:
            raise OperationalError("SELECT 1", {}, Exception("connection refused\nis the server running?"))
        return maker()

    worker = AnalysisWorker(flaky, Settings(db=db_url, analysis_interval_seconds=0.05), clock=lambda: NOW)
    with caplog.at_level(logging.ERROR, logger="trainvitals.service"):
        worker.start()
        try:
            assert _wait_for(lambda: _summarised(maker, "r") == 20)
        finally:
            worker.stop()
    failed = [r for r in caplog.records if "analysis cycle failed" in r.getMessage()]
    assert len(failed) == 1 and "connection refused" in failed[0].getMessage()
    assert "\n" not in failed[0].getMessage() and failed[0].exc_info is None
    assert worker.errors == 1
    with maker() as session:
        status = analysis_status.read(session)
        assert status is not None and status.errors == 1


def test_a_run_deleted_mid_cycle_leaves_no_summary_for_a_reused_run_id(maker, db_url: str) -> None:
    """The run is deleted while its cycle reads its rows: the cycle's writes are dropped (or
    deleted with the run), so the run registered again under the same id starts empty."""
    _store(maker, "r")
    real = pipeline.detector_blocks.forget_from
    deleter: list[threading.Thread] = []

    def delete_meanwhile(session, **kw):
        if not deleter:  # the first write of the cycle's rewrite: the rows are read
            def delete() -> None:
                with maker() as other:
                    assert queries.delete_run(other, run_id="r")

            deleter.append(threading.Thread(target=delete))
            deleter[0].start()
            deleter[0].join(0.5)  # SQLite: done; PostgreSQL: waiting for the cycle's lock on the run
        return real(session, **kw)

    worker = AnalysisWorker(maker, Settings(db=db_url), clock=lambda: NOW)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline.detector_blocks, "forget_from", delete_meanwhile)
        worker.run_once()
    deleter[0].join(10)
    assert not deleter[0].is_alive() and worker.errors == 0
    with maker() as session:
        assert queries.get_run(session, run_id="r") is None
        assert session.get(ReductionState, "r") is None
    assert _summarised(maker, "r") == 0
    _store(maker, "r", steps=0)  # the same id, a new run: nothing inherited
    assert _summarised(maker, "r") == 0


def test_a_holder_that_lost_the_lease_mid_cycle_writes_nothing(
    pg_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The old holder's lease session is ended after it read the rows; another process takes the
    lease and reduces newer rows; the old holder's writes are refused, and it says so once."""
    url = pg_url
    engines = [db.make_engine(url) for _ in range(2)]
    old_maker, new_maker = (db.make_sessionmaker(e) for e in engines)
    with engines[0].begin() as conn:  # the session's database: emptied as db_url empties it
        conn.execute(text("TRUNCATE " + ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables) + " CASCADE"))
    _store(old_maker, "r")
    old_lease, new_lease = AnalysisLease(engines[0]), AnalysisLease(engines[1])
    settings = Settings(db=url, analysis_interval_seconds=0.05)
    old = AnalysisWorker(old_maker, settings, clock=lambda: NOW, lease=old_lease)
    new = AnalysisWorker(new_maker, settings, clock=lambda: NOW, lease=new_lease)
    real = pipeline.detector_blocks.forget_from
    took_over = threading.Event()

    def new_holder() -> None:
        assert _wait_for(new_lease.acquire)
        new.run_once()  # reduces the newer rows (once the old holder's transaction has ended)

    newer = threading.Thread(target=new_holder)

    def take_over(session, **kw):
        if not took_over.is_set():  # the old holder read loss 2.0; now its lease session ends
            took_over.set()
            with psycopg.connect(url.replace("+psycopg", ""), autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (old_lease.backend_pid,))
            with new_maker() as s:
                s.execute(update(StepRow).where(StepRow.run_id == "r").values(loss=5.0))
                s.commit()
            newer.start()
            newer.join(3)  # unfenced, the new holder's cycle ends meanwhile; fenced, it waits for this one
        return real(session, **kw)

    try:
        with caplog.at_level(logging.WARNING, logger="trainvitals.service"), pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipeline.detector_blocks, "forget_from", take_over)
            assert old_lease.acquire()
            old.start()
            assert _wait_for(lambda: not old_lease.held)
            newer.join(10)
            time.sleep(0.3)  # a few more cycles: the lease is the new holder's now
            old.stop()
        assert took_over.is_set() and not newer.is_alive() and new.errors == 0
        with new_maker() as session:
            losses = session.scalars(select(StepSummary.loss).where(StepSummary.run_id == "r")).all()
        assert losses == [5.0] * 20
        lost = [r for r in caplog.records if "analysis lease lost" in r.getMessage()]
        assert len(lost) == 1
    finally:
        old.stop()
        old_lease.release()
        new_lease.release()
        for e in engines:
            e.dispose()


def test_a_holder_that_lost_the_lease_records_no_failure_and_no_cycle(pg_url: str) -> None:
    """The old holder's analysis of a run raised after its lease ended: its `analysis_failed`
    finding and its cycle's status row were written unfenced, a failure on a run the new holder
    analyses and a status naming the wrong holder."""
    engine = db.make_engine(pg_url)
    maker = db.make_sessionmaker(engine)
    with engine.begin() as conn:
        conn.execute(text("TRUNCATE " + ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables) + " CASCADE"))
    _store(maker, "r")
    lease = AnalysisLease(engine)
    worker = AnalysisWorker(maker, Settings(db=pg_url), clock=lambda: NOW, lease=lease)

    def lose_the_lease_and_fail(*args, **kwargs):
        with psycopg.connect(pg_url.replace("+psycopg", ""), autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (lease.backend_pid,))
        raise RuntimeError("the analysis broke after the lease ended")

    try:
        assert lease.acquire()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(pipeline, "process_run", lose_the_lease_and_fail)
            assert worker.run_once() == 0
        assert worker.errors == 1  # counted in this process, and logged
        with maker() as session:
            assert session.scalars(select(FindingRow.kind).where(FindingRow.run_id == "r")).all() == []
            assert analysis_status.read(session) is None
    finally:
        worker.stop()
        lease.release()
        engine.dispose()


def test_a_holder_that_takes_the_lease_again_reads_its_runs_afresh(maker, db_url: str) -> None:
    """acquire() tells a lease still held from one taken again: another process may have analysed
    in between, so the detector input kept from before is stale and the worker drops it."""
    _store(maker, "r")
    engine = db.make_engine(db_url)
    lease = AnalysisLease(engine)
    worker = AnalysisWorker(maker, Settings(db=db_url), clock=lambda: NOW, lease=lease)
    try:
        assert lease.acquire()
        taken = lease.taken
        assert lease.acquire() and lease.taken == taken  # still held
        worker.run_once()
        kept = worker._inputs["r"]
        worker.run_once()
        assert worker._inputs["r"] is kept  # held all along: what it read stays good
        lease.release()  # as when the lease session ends between two cycles
        worker.run_once()
        assert lease.taken == taken + 1 and worker._inputs["r"] is not kept  # taken anew: read afresh
    finally:
        lease.release()
        engine.dispose()


def test_the_lease_session_notices_a_vanished_peer_within_seconds(pg_url: str) -> None:
    """The server's default keepalive (2 hours) would keep a vanished holder's lease that long."""
    engine = db.make_engine(pg_url)
    lease = AnalysisLease(engine)
    try:
        assert _wait_for(lease.acquire)
        idle = lease._held.execute("SHOW tcp_keepalives_idle").fetchone()[0]
        count = lease._held.execute("SHOW tcp_keepalives_count").fetchone()[0]
        assert (idle, count) == ("10", "3")
    finally:
        lease.release()
        engine.dispose()


def test_replay_into_a_database_a_collector_analyses_leaves_the_analysis_to_it(
    maker, db_url: str, tmp_path: Path
) -> None:
    """`trainvitals replay --db` of a live collector's database: the collector's analysis holds the
    lease, so the replay stores the records and says the collector analyses them."""
    records = [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0, "loss": 2.0} for s in range(5)]
    spool = tmp_path / "spool.jsonl"
    spool.write_text(json.dumps({"run": "r", "rank": 0, "incarnation": 1, "seq": 1, "records": records}) + "\n")
    _store(maker, "r", steps=0)
    engine = db.make_engine(db_url)
    collector = AnalysisLease(engine)
    try:
        assert _wait_for(collector.acquire)
        with maker() as session:
            report = replay_files(session, [str(spool)])
        assert report.records == 5 and report.steps_reduced == 0
        assert report.analysis.startswith("skipped: a collector holds the analysis lease")
        assert _summarised(maker, "r") == 0
        collector.release()  # no collector: the replay analyses
        later = [{"kind": "step", "step": 5, "ts": 105.0, "step_seconds": 1.0, "loss": 2.0}]
        spool.write_text(json.dumps({"run": "r", "rank": 0, "incarnation": 1, "seq": 2, "records": later}) + "\n")
        with maker() as session:
            report = replay_files(session, [str(spool)])
        assert report.analysis == "done" and _summarised(maker, "r") == 6
    finally:
        collector.release()
        engine.dispose()


def test_a_replica_whose_clock_is_behind_does_not_move_last_seen_back(maker, monkeypatch) -> None:
    """Replica B (clock 100 s behind) read the run before replica A's batch stored NOW: its
    update comes last, and must not set the run's last seen and last step times back."""
    _store(maker, "r", steps=1)
    real = batches._runs_and_fences

    def read_before_a(session, run_ids, incarnations):
        runs, fenced = real(session, run_ids, incarnations)
        return {k: r._replace(last_seen_at=NOW - 200, last_step_at=NOW - 200) for k, r in runs.items()}, fenced

    monkeypatch.setattr(batches, "_runs_and_fences", read_before_a)
    body = {"run": "r", "rank": 0, "incarnation": 1, "seq": 2,
            "records": [{"kind": "step", "step": 1, "ts": 101.0, "step_seconds": 1.0}]}  # fmt: skip
    with maker() as session:
        batches.store_batch(session, Batch.model_validate(body), now=NOW - 100)
    with maker() as session:
        run = queries.get_run(session, run_id="r")
        assert run is not None and (run.last_seen_at, run.last_step_at) == (NOW, NOW)
