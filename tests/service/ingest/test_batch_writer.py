"""Group commit: store_batches and the BatchWriter thread, on SQLite and PostgreSQL."""

import asyncio
import sqlite3
import threading
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
import sqlalchemy
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from trainvitals.service.ingest.batch_writer import BatchWriter, WriterBusyError, database_reason
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db, queries
from trainvitals.service.store.models import DeliveredBatch, StepRow, TensorStatRow
from trainvitals.wire import Batch, BatchAck, RunRegistration


def _batch(rank: int, seq: int, *, run: str = "r1") -> Batch:
    steps = range(seq * 2, seq * 2 + 2)
    records: list[dict[str, object]] = [
        {"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 0.5} for s in steps
    ]
    records += [
        {
            "kind": "tensor",
            "step": s,
            "tensor": "blocks.0.fc1",
            "role": "input",
            "format": "e4m3",
            "amax": 3.0,
            "staleness_steps": 3,
        }
        for s in steps
    ]
    return Batch.model_validate({"run": run, "rank": rank, "incarnation": 1, "seq": seq, "records": records})


def _count(factory, model) -> int:
    with factory() as s:
        return int(s.scalar(select(func.count()).select_from(model)) or 0)


def test_one_group_decides_each_batch_on_its_own(sessions) -> None:
    with sessions() as s:
        batches.store_batch(s, _batch(0, 0))  # stored before: its retry below is a duplicate
        outcomes = batches.store_batches(
            s,
            [
                (_batch(1, 0), "a"),
                (_batch(0, 0), "a"),  # already in the database
                (_batch(1, 0), "a"),  # the same batch twice in one group (a retry beside its original)
                (_batch(2, 0, run="nope"), "a"),
                (_batch(3, 0, run="r2"), "a"),  # project a has no r2 (project b's is another run)
                (_batch(4, 0), None),  # auth off: the one run r1, a's
            ],
        )
    assert outcomes[0] == BatchAck(accepted=4, duplicate=False)
    assert outcomes[1] == BatchAck(accepted=0, duplicate=True)
    assert outcomes[2] == BatchAck(accepted=0, duplicate=True)
    assert isinstance(outcomes[3], batches.UnknownRunError)
    assert str(outcomes[4]) == "run 'r2' is not registered: POST /v1/runs first"  # nothing said of b's
    assert outcomes[5] == BatchAck(accepted=4, duplicate=False)
    # ranks 0, 1 and 4, two steps each, once
    assert _count(sessions, StepRow) == 6
    assert _count(sessions, TensorStatRow) == 6
    assert _count(sessions, DeliveredBatch) == 3
    with sessions() as s:
        counts = {(c.run_id, c.outcome): (c.batches, c.records) for c in queries.ingest_counts(s)}
        project_a = {(c.run_id, c.outcome) for c in queries.ingest_counts(s, project="a")}
    assert counts == {
        ("a/r1", "stored"): (3, 12),  # the earlier store_batch and this group's two (a's key)
        ("a/r1", "duplicate"): (2, 0),
        ("a/", "rejected"): (2, 0),  # unknown runs, under the sender's project: not a label per typo
    }
    assert project_a == {("a/r1", "stored"), ("a/r1", "duplicate"), ("a/", "rejected")}


def _first_session_held(sessions):
    """A session factory whose first call blocks until `gate` is set: the writer is "committing"
    its first group while the batches submitted meanwhile queue up. `opened`: that call began."""
    opened, gate = threading.Event(), threading.Event()

    def factory():
        if not opened.is_set():
            opened.set()
            gate.wait(10)
        return sessions()

    return opened, gate, factory


def test_writer_groups_what_queued_during_a_commit(sessions) -> None:
    opened, gate, slow_first_session = _first_session_held(sessions)
    observed: list[tuple[int, float]] = []  # what /metrics is told: (batches, seconds) per group
    writer = BatchWriter(slow_first_session, observe_group=lambda n, seconds: observed.append((n, seconds)))
    try:
        first = writer.submit(_batch(0, 0), project=None)
        assert opened.wait(10)
        rest = [writer.submit(_batch(rank, 0), project=None) for rank in range(1, 8)]
        threading.Event().wait(0.2)  # the first group's commit takes at least this long
        gate.set()
        acks = [f.result(10) for f in (first, *rest)]
    finally:
        writer.stop()
    assert all(a == BatchAck(accepted=4, duplicate=False) for a in acks)
    assert writer.groups == 2  # the first batch alone, then the seven that waited: one commit
    assert _count(sessions, StepRow) == 16
    assert [n for n, _ in observed] == [1, 7]
    assert observed[0][1] >= 0.2 and 0 < observed[1][1] < observed[0][1]


@pytest.mark.parametrize(
    ("wait_s", "apart_s", "groups"),
    [
        (0.6, 0.06, 1),  # each next batch within half the wait (0.3 s), all within it: one transaction
        (0.4, 0.3, 5),  # a pause past half the wait (0.2 s) ends it: a wait to its end would make 3 groups
        (0.0, 0.06, None),  # no wait: each written as it comes (more than one group)
    ],
)
def test_a_writer_told_to_wait_gathers_batches_while_they_keep_coming(
    sessions, wait_s: float, apart_s: float, groups: int | None
) -> None:
    writer = BatchWriter(sessions, group_wait_s=wait_s)
    try:
        futures = []
        for rank in range(5):
            futures.append(writer.submit(_batch(rank, 0), project=None))
            threading.Event().wait(apart_s)
        assert all(f.result(10) == BatchAck(accepted=4, duplicate=False) for f in futures)
    finally:
        writer.stop()
    assert writer.groups == groups if groups is not None else writer.groups > 1, writer.groups
    assert _count(sessions, StepRow) == 10


def test_a_full_group_is_written_without_waiting(sessions) -> None:
    """A writer stops waiting once its group holds full_group_records: here two batches of 4 records
    are answered long before the 60 s the writer would otherwise wait."""
    writer = BatchWriter(sessions, group_wait_s=60.0, full_group_records=8)
    try:
        futures = [writer.submit(_batch(rank, 0), project=None) for rank in range(2)]
        assert all(f.result(10) == BatchAck(accepted=4, duplicate=False) for f in futures)
    finally:
        writer.stop()


def test_concurrent_senders_and_retries_store_every_record_once(sessions) -> None:
    writer = BatchWriter(sessions, threads=2)
    batches = [_batch(rank, seq) for rank in range(8) for seq in range(6)]
    try:
        with ThreadPoolExecutor(8) as pool:
            # every batch sent twice, from different threads, as an agent retrying after a timeout would
            acks = list(pool.map(lambda b: writer.submit(b, project="a").result(30), batches + batches))
    finally:
        writer.stop()
    assert sum(a.accepted for a in acks) == 48 * 4
    assert sum(a.duplicate for a in acks) == 48
    assert _count(sessions, StepRow) == 48 * 2
    assert _count(sessions, DeliveredBatch) == 48
    # The counters /metrics exports were kept by the same transactions, per writer thread: exact.
    with sessions() as s:
        counts = {(c.run_id, c.outcome): (c.batches, c.records) for c in queries.ingest_counts(s)}
    assert counts == {("a/r1", "stored"): (48, 48 * 4), ("a/r1", "duplicate"): (48, 0)}


def _unvalidated(batch: Batch, **tensor_values: object) -> Batch:
    records = [r.model_copy(update=tensor_values) if r.kind == "tensor" else r for r in batch.records]
    return batch.model_copy(update={"records": records})


def _with_checkpoint_path(batch: Batch, path: str) -> Batch:
    save = Batch.model_validate({**batch.model_dump(), "records": [
        {"kind": "checkpoint", "step": 0, "generation": 1, "status": "persisted", "ts": 1.0}]}).records[0]
    return batch.model_copy(update={"records": [*batch.records, save.model_copy(update={"path": path})]})


@pytest.mark.parametrize(
    "bad",
    [
        lambda b: _unvalidated(b, staleness_steps=2**70),
        lambda b: _unvalidated(b, tensor="layers.0.\udcff"),
        lambda b: _with_checkpoint_path(b, "/ck/\udcffgen-1"),
    ],
    ids=["past_the_column", "lone_surrogate", "lone_surrogate_through_the_orm"],
)
def test_a_value_the_database_refuses_rejects_only_its_batch(sessions, bad) -> None:
    """A value no database stores (staleness_steps 2**70: a 32-bit column on PostgreSQL, 64-bit on
    SQLite; a lone surrogate, which no UTF-8 text holds: it was a 503, retried for ever). The wire
    refuses both (test_ranges.py; the JSON decoders); the writer's backstop, for what reaches it
    (a column narrower than its wire range, a large body's lax decode), is tested on a batch built
    without validation. The group it landed in is retried batch by batch, so its neighbours are
    stored and only it is refused (no retry loop)."""
    opened, gate, slow_first_session = _first_session_held(sessions)
    observed: list[int] = []
    writer = BatchWriter(slow_first_session, observe_group=lambda n, _: observed.append(n))
    try:
        first = writer.submit(_batch(0, 0), project=None)
        assert opened.wait(10)
        refused = writer.submit(bad(_batch(1, 0)), project=None)
        good = writer.submit(_batch(2, 0), project=None)
        gate.set()
        outcomes = [first.result(10), refused.result(10), good.result(10)]
    finally:
        writer.stop()
    assert outcomes[0].accepted == 4 and outcomes[2].accepted == 4
    assert isinstance(outcomes[1], batches.UnstorableBatchError)
    # The driver's first line, not SQLAlchemy's text with the statement and the batch's parameters.
    reason = str(outcomes[1])
    assert reason.count("\n") == 0 and "[SQL:" not in reason and "INSERT" not in reason, reason
    assert _count(sessions, StepRow) == 4  # ranks 0 and 2; nothing of rank 1
    assert _count(sessions, DeliveredBatch) == 2
    with sessions() as s:
        counts = {(c.run_id, c.outcome): c.batches for c in queries.ingest_counts(s)}
    assert counts == {("a/r1", "stored"): 2, ("a/r1", "rejected"): 1}
    assert observed == [1, 2]  # the refused group once, as the writer took it (its one-by-one retries inside)


def test_a_client_is_told_the_drivers_first_line_not_the_statement(sessions) -> None:
    """The 503 and 422 texts said str(exc): SQLAlchemy's, with the statement and every bound
    parameter (a batch's values, or another's in a group)."""
    with sessions() as session, pytest.raises(sqlalchemy.exc.DBAPIError) as info:
        session.execute(sqlalchemy.text("INSERT INTO no_such_table VALUES (:secret)"), {"secret": "hunter2"})
    assert "hunter2" in str(info.value) and "INSERT" in str(info.value)  # what was sent before
    reason = database_reason(info.value)
    assert reason.split(": ")[0] in ("OperationalError", "UndefinedTable") and "no_such_table" in reason, reason
    assert "hunter2" not in reason and "INSERT" not in reason and "\n" not in reason


def test_backpressure_refuses_past_the_pending_bound(sessions) -> None:
    gate = threading.Event()

    def blocked():
        gate.wait(10)
        return sessions()

    writer = BatchWriter(blocked, max_pending_records=10)
    try:
        first = writer.submit(_batch(0, 0), project=None)  # 4 records pending
        second = writer.submit(_batch(1, 0), project=None)  # 8
        with pytest.raises(WriterBusyError):
            writer.submit(_batch(2, 0), project=None)  # 12 > 10
        gate.set()
        assert first.result(10).accepted == 4 and second.result(10).accepted == 4
        assert writer.submit(_batch(2, 0), project=None).result(10).accepted == 4  # drained: accepted again
    finally:
        gate.set()
        writer.stop()


def test_stop_writes_what_was_accepted(sessions) -> None:
    writer = BatchWriter(sessions)
    futures = [writer.submit(_batch(rank, 0), project=None) for rank in range(8)]
    writer.stop()
    assert all(f.done() and f.result().accepted == 4 for f in futures)
    assert _count(sessions, StepRow) == 16


def _wide_batch(rank: int, seq: int, steps: int) -> Batch:
    """`steps` steps x (1 step + 1 tensor record): enough rows to cross several statement chunks."""
    records: list[dict[str, object]] = []
    for s in range(seq * steps, (seq + 1) * steps):
        records.append({"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 0.5})
        records.append(
            {"kind": "tensor", "step": s, "tensor": "blocks.0.fc1", "role": "input", "format": "e4m3", "amax": 3.0}
        )
    return Batch.model_validate({"run": "r1", "rank": rank, "incarnation": 1, "seq": seq, "records": records})


def test_sqlite_groups_larger_than_a_statement_store_every_row_once(tmp_path) -> None:
    """SQLite inserts a group's rows (and its idempotency rows) in multi-row statements sized to
    the library's variable limit: with the limit lowered to 999 (old builds), a group of 70
    batches and 10,500 records still stores each record once and tells duplicates apart."""
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)

    @sqlalchemy.event.listens_for(engine, "connect")
    def _low_limit(dbapi_conn, _record) -> None:
        dbapi_conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)

    factory = db.make_sessionmaker(engine)
    with factory() as s:
        batches.register_run(s, RunRegistration(run="r1", project="a"))
        batches.store_batch(s, _wide_batch(0, 1, 75))
        group = [(_wide_batch(rank, seq, 75), "a") for rank in range(35) for seq in (0, 1)]
        outcomes = batches.store_batches(s, group)
    assert [o.duplicate for o in outcomes] == [rank == 0 and seq == 1 for rank in range(35) for seq in (0, 1)]
    assert _count(factory, DeliveredBatch) == 70
    assert _count(factory, StepRow) == _count(factory, TensorStatRow) == 70 * 75
    engine.dispose()


def test_batches_submitted_on_an_event_loop_are_answered_there_one_callback_per_group(sessions) -> None:
    """The route submits on the event loop: its futures are the loop's own, settled on the loop's
    thread after the commit, refusals as results and not raised; a waiter that went away (its
    request cancelled) does not keep the others of its group from their answers."""
    opened, gate, slow_first_session = _first_session_held(sessions)
    writer = BatchWriter(slow_first_session)

    async def scenario() -> tuple[list[object], set[int], int]:
        answered_on: set[int] = set()
        first = writer.submit(_batch(0, 0), project=None)
        assert await asyncio.to_thread(opened.wait, 10)
        group = [
            writer.submit(_batch(1, 0), project=None),
            writer.submit(_batch(0, 0), project=None),  # a retry of the first: a duplicate
            writer.submit(_batch(2, 0, run="nope"), project=None),
            writer.submit(_batch(3, 0), project=None),  # its waiter goes away before the commit
            writer.submit(_batch(4, 0), project=None),
        ]
        for future in (first, *group):
            assert isinstance(future, asyncio.Future)
            future.add_done_callback(lambda _f: answered_on.add(threading.get_ident()))
        group[3].cancel()
        gate.set()
        outcomes = await asyncio.gather(*(asyncio.wrap_future(f) for f in (first, *group)), return_exceptions=True)
        return outcomes, answered_on, threading.get_ident()

    try:
        outcomes, answered_on, loop_thread = asyncio.run(scenario())
    finally:
        gate.set()
        writer.stop()
    first, new, duplicate, unknown, cancelled, last = outcomes
    assert first == new == last == BatchAck(accepted=4, duplicate=False)
    assert duplicate == BatchAck(accepted=0, duplicate=True)
    assert isinstance(unknown, batches.UnknownRunError)
    assert isinstance(cancelled, asyncio.CancelledError)
    assert answered_on == {loop_thread}
    assert writer.groups == 2
    assert _count(sessions, DeliveredBatch) == 4  # ranks 0, 1, 3 (stored though nobody waited) and 4


@pytest.mark.parametrize("synchronous", [False, True], ids=["default", "ingest_synchronous_commit"])
def test_postgresql_ingest_waits_for_the_wal_flush_only_when_configured(empty_pg_url: str, synchronous: bool) -> None:
    """By default the collector's ingest transaction commits with synchronous_commit off (the batch is
    acknowledged before PostgreSQL flushes its WAL, as SQLite's synchronous=NORMAL: a collector crash
    loses nothing); with TRAINVITALS_INGEST_SYNCHRONOUS_COMMIT it keeps the database's own setting.
    The setting is the transaction's: the connection goes back to the pool as it came."""
    with psycopg.connect(empty_pg_url.replace("+psycopg", "")) as conn:
        server_default = conn.execute("SHOW synchronous_commit").fetchone()[0]
    assert server_default != "off", "this test needs a server whose default synchronous_commit is not off"
    overrides = {"ingest_synchronous_commit": True} if synchronous else {}
    app = create_app(Settings(db=empty_pg_url, auth=False, run_analysis=False, **overrides))
    committed: list[str] = []  # synchronous_commit in force at each commit of the app's sessions

    @sqlalchemy.event.listens_for(app.state.sessionmaker, "before_commit")
    def _record(session: Session) -> None:
        committed.append(session.execute(sqlalchemy.text("SHOW synchronous_commit")).scalar_one())

    with TestClient(app) as client:
        assert client.post("/v1/runs", json={"run": "r1", "parallelism": {"world_size": 1}}).status_code == 201
        assert committed and set(committed) == {server_default}  # registration: the database's own
        committed.clear()
        body = _batch(0, 0).model_dump(mode="json", exclude_none=True)
        assert client.post("/v1/batches", json=body).json() == {"accepted": 4, "duplicate": False}
        assert committed == [server_default if synchronous else "off"]
        with app.state.sessionmaker() as s:  # the pool's connections are back at the server's default
            assert s.execute(sqlalchemy.text("SHOW synchronous_commit")).scalar_one() == server_default
