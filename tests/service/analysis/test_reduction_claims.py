"""The claim protocol between ingest and the reduction (store/summaries.py): a row for a step whose
reduction is in flight is never missed by the summary, whichever side gets there first. Both
interleavings are forced, on both backends."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session

from trainvitals.service.analysis import pipeline
from trainvitals.service.store import batches, db, queries, summaries
from trainvitals.service.store.models import ReductionState, StepSummary
from trainvitals.wire import Batch, RunRegistration

RUN = "claims"
NOW = 1e9  # every step long settled: the reduction takes whatever ranks have sent


@pytest.fixture
def maker(db_url: str):
    engine = db.make_engine(db_url)
    yield db.make_sessionmaker(engine)
    engine.dispose()


def _batch(rank: int, steps: range) -> Batch:
    records = [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0 + rank} for s in steps]
    return Batch.model_validate({"run": RUN, "rank": rank, "incarnation": 1, "seq": 0, "records": records})


def _setup(maker) -> None:
    """Three ranks; ranks 0 and 1 have sent steps 0..9, rank 2 is late."""
    with maker() as session:
        batches.register_run(session, RunRegistration(run=RUN, parallelism={"world_size": 3}))
        pipeline.reduce_run(session, queries.get_run(session, run_id=RUN), now=NOW)  # no steps yet: state row
        for rank in (0, 1):
            batches.store_batch(session, _batch(rank, range(10)))


def _reduce(maker) -> int:
    with maker() as session:
        return pipeline.reduce_run(session, queries.get_run(session, run_id=RUN), now=NOW)


def _ranks(maker) -> dict[int, int]:
    with maker() as session:
        return dict(session.execute(select(StepSummary.step, StepSummary.ranks).where(StepSummary.run_id == RUN)).all())


def test_a_row_stored_while_the_reduction_runs_is_reduced_next_cycle(maker, monkeypatch) -> None:
    """The reduction has claimed and read steps 0..9 when rank 2's batch is stored: its summary
    misses the rows, so the ingest must re-dirty the steps (before the claim protocol it saw them
    as not reduced yet, and the summary kept 2 ranks forever)."""
    _setup(maker)
    original = summaries.replace_summaries

    def late_batch_then_write(session: Session, **kwargs) -> None:
        with maker() as other:  # another writer thread of the collector, between the reads and the write
            batches.store_batch(other, _batch(2, range(10)))
        original(session, **kwargs)

    monkeypatch.setattr(summaries, "replace_summaries", late_batch_then_write)
    assert _reduce(maker) == 10
    monkeypatch.setattr(summaries, "replace_summaries", original)
    assert set(_ranks(maker).values()) == {2}  # this cycle read before the rows existed
    with maker() as session:
        state = session.get(ReductionState, RUN)
        assert (state.reduced_upto, state.dirty_from) == (9, 0)  # ...and the steps are dirty again
    assert _reduce(maker) == 10
    assert _ranks(maker) == {s: 3 for s in range(10)}


class _HeldCommit(Session):
    """A session whose commit waits until released: an ingest transaction caught mid-flight."""

    def __init__(self, *args, entered: threading.Event, release: threading.Event, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._entered, self._release = entered, release

    def commit(self) -> None:
        self._entered.set()
        assert self._release.wait(30)
        super().commit()


def test_a_reduction_claiming_while_a_batch_is_being_stored_waits_for_it(maker, db_url: str) -> None:
    """Rank 2's batch has inserted its rows but not committed when the reduction starts: the claim
    waits for that transaction (PostgreSQL: the run row's lock; SQLite: the one writer), so the
    reduction reads the rows. Without it, the reduction read without them while the ingest, seeing
    the steps unreduced, did not re-dirty them."""
    _setup(maker)
    engine = db.make_engine(db_url)
    entered, release, ingest_done = threading.Event(), threading.Event(), threading.Event()
    failures: list[BaseException] = []

    def ingest() -> None:
        try:
            with _HeldCommit(engine, entered=entered, release=release) as session:
                batches.store_batch(session, _batch(2, range(10)))
            ingest_done.set()
        except BaseException as exc:  # noqa: BLE001 - reported by the test body
            failures.append(exc)

    def reduce() -> None:
        try:
            _reduce(maker)
        except BaseException as exc:  # noqa: BLE001
            failures.append(exc)

    writer = threading.Thread(target=ingest, name="test-ingest")
    reducer = threading.Thread(target=reduce, name="test-reduce")
    writer.start()
    try:
        assert entered.wait(30)
        reducer.start()
        reducer.join(1.0)
        assert reducer.is_alive(), "the reduction did not wait for the ingest transaction in flight"
    finally:
        release.set()
        writer.join(30)
        reducer.join(60)
        engine.dispose()
    assert not failures and ingest_done.is_set()
    assert _ranks(maker) == {s: 3 for s in range(10)}  # one cycle: the rows were in its reads
