"""store_batch: atomic, idempotent, on SQLite and PostgreSQL."""

import json
import math

import pytest
from sqlalchemy import func, select

from trainvitals.service.ingest.decode import decode_batch
from trainvitals.service.store import batches, db, queries
from trainvitals.service.store.models import DeliveredBatch, GradStatRow, StepRow, TensorStatRow
from trainvitals.wire import Batch, RunRegistration


def _steps(rank: int, steps: range, seq: int, incarnation: int = 1) -> Batch:
    records = [
        {
            "kind": "step",
            "step": s,
            "ts": 100.0 + s,
            "step_seconds": 0.1 * (rank + 1),
            "loss": 2.0,
            "tokens": 64,
        }
        for s in steps
    ]
    records += [
        {
            "kind": "grad",
            "step": s,
            "group": "__global__",
            "owned_sq": 4.0 if rank == 0 else 0.0,
            "local_sq": 4.0,
        }
        for s in steps
    ]
    return Batch.model_validate({"run": "r1", "rank": rank, "incarnation": incarnation, "seq": seq, "records": records})


def test_batches_are_stored_once(session) -> None:
    batches.register_run(session, RunRegistration(run="r1", parallelism={"world_size": 2}))
    first = batches.store_batch(session, _steps(0, range(0, 10), seq=0))
    again = batches.store_batch(session, _steps(0, range(0, 10), seq=0))
    batches.store_batch(session, _steps(1, range(0, 10), seq=0))
    assert (first.accepted, first.duplicate) == (20, False)
    assert (again.accepted, again.duplicate) == (0, True)
    assert queries.count_step_rows(session, run_id="r1") == 20
    assert session.scalar(select(func.count()).select_from(DeliveredBatch)) == 2


def test_seq_only_makes_delivery_idempotent_gaps_and_reordering_are_accepted(session) -> None:
    """What docs/wire-format.md ("Delivery") promises about seq: each (run, rank, incarnation, seq)
    is stored once, whenever it comes again; batches are stored as they arrive, out of order and
    with gaps (seq 1, 3 and 4 never come); records are ordered by step, so a batch arriving after
    later steps were reduced re-dirties them and the summaries cover every step sent."""
    from trainvitals.service.analysis import pipeline
    from trainvitals.service.store.models import StepSummary

    batches.register_run(session, RunRegistration(run="r1", parallelism={"world_size": 1}))
    run = queries.get_run(session, run_id="r1")
    acks = [batches.store_batch(session, _steps(0, range(10, 15), seq=5))]
    assert pipeline.reduce_run(session, run, now=1e9) == 5  # steps 10..14
    acks += [batches.store_batch(session, _steps(0, range(0, 5), seq=0))]  # older, after a gap
    acks += [batches.store_batch(session, _steps(0, range(5, 10), seq=2))]
    acks += [batches.store_batch(session, _steps(0, range(10, 15), seq=5))]  # a late retry: duplicate
    acks += [batches.store_batch(session, _steps(0, range(0, 5), seq=0))]
    assert [(a.accepted, a.duplicate) for a in acks] == [(10, False)] * 3 + [(0, True)] * 2
    assert pipeline.reduce_run(session, run, now=1e9) == 15  # the late steps re-dirtied 0..14
    summarised = session.scalars(select(StepSummary.step).order_by(StepSummary.step)).all()
    assert summarised == list(range(15))
    assert queries.count_step_rows(session, run_id="r1") == 15
    assert sorted(session.scalars(select(DeliveredBatch.seq))) == [0, 2, 5]


def test_a_group_of_new_batches_and_retries_stores_each_new_one_once(session) -> None:
    """One transaction claims a group's keys with one INSERT that skips those already stored (on
    SQLite without RETURNING, the new ones read back by rowid when some were skipped): each item's
    outcome is its own, whatever the mix, and a retry stores nothing."""
    batches.register_run(session, RunRegistration(run="r1", parallelism={"world_size": 4}))
    batches.store_batches(session, [(_steps(1, range(0, 3), seq=0), None), (_steps(3, range(0, 3), seq=0), None)])
    group = [_steps(rank, range(0, 3), seq=seq) for rank, seq in [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1)]]
    outcomes = batches.store_batches(session, [(b, None) for b in group])
    assert [(o.accepted, o.duplicate) for o in outcomes] == [
        (6, False), (0, True), (6, False), (6, False), (0, True), (6, False)
    ]  # fmt: skip
    again = batches.store_batches(session, [(b, None) for b in group])
    assert [(o.accepted, o.duplicate) for o in again] == [(0, True)] * 6
    assert queries.count_step_rows(session, run_id="r1") == 3 * 6
    stored = session.execute(select(DeliveredBatch.rank, DeliveredBatch.seq)).all()
    assert sorted(map(tuple, stored)) == [(0, 0), (1, 0), (1, 1), (2, 0), (3, 0), (3, 1)]


def test_on_sqlite_a_small_groups_rows_of_a_kind_are_one_statement(tmp_path) -> None:
    """Every sqlite3 statement releases the GIL and waits to take it back from the event loop, so a
    small group's rows of a kind go in one INSERT below 16 rows (not one per power of two: these 7
    would be 4 + 2 + 1), and the claim is one INSERT whose rows are not fetched back. (PostgreSQL
    writes a kind with one COPY whatever the count.)"""
    url = f"sqlite:///{tmp_path / 'tv.db'}"
    db.upgrade(url)
    engine = db.make_engine(url)
    with db.make_sessionmaker(engine)() as session:
        batches.register_run(session, RunRegistration(run="r1"))
        statements: list[str] = []
        dbapi = session.connection().connection.driver_connection
        dbapi.set_trace_callback(statements.append)
        try:
            group = [(_steps(0, range(0, 4), seq=0), None), (_steps(0, range(4, 7), seq=1), None)]
            outcomes = batches.store_batches(session, group)
        finally:
            dbapi.set_trace_callback(None)
        assert [(o.accepted, o.duplicate) for o in outcomes] == [(8, False), (6, False)]
        inserts = sorted(s.split(" (")[0] for s in statements if s.startswith("INSERT INTO"))
        assert inserts == [f"INSERT INTO {t}" for t in ("batches", "grad_stats", "ingest_counts", "steps")]
        assert queries.count_step_rows(session, run_id="r1") == 7
    engine.dispose()


def test_new_incarnation_with_same_seq_is_not_a_duplicate(session) -> None:
    batches.register_run(session, RunRegistration(run="r1"))
    batches.store_batch(session, _steps(0, range(0, 5), seq=0, incarnation=1))
    ack = batches.store_batch(session, _steps(0, range(3, 8), seq=0, incarnation=2))
    assert not ack.duplicate
    assert {k[1] for k in queries.step_keys(session, run_id="r1")} == {1, 2}


def test_unregistered_run_is_refused_and_stores_nothing(session) -> None:
    with pytest.raises(batches.UnknownRunError):
        batches.store_batch(session, _steps(0, range(3), seq=0))
    session.rollback()
    assert session.scalar(select(func.count()).select_from(StepRow)) == 0


def test_registration_is_idempotent_and_run_ids_are_the_projects_own(session) -> None:
    assert batches.register_run(session, RunRegistration(run="r1", project="a")) is True
    assert batches.register_run(session, RunRegistration(run="r1", project="a")) is False
    # Another project's r1 is another run: nothing of a's is touched or told.
    assert batches.register_run(session, RunRegistration(run="r1", project="b")) is True
    assert {r.run_id: r.project for r in queries.list_runs(session)} == {"a/r1": "a", "b/r1": "b"}
    for project, steps in (("a", range(3)), ("b", range(5))):
        batches.store_batch(session, _steps(0, steps, seq=0), project=project)
    assert queries.count_step_rows(session, run_id="a/r1") == 3
    assert queries.count_step_rows(session, run_id="b/r1") == 5
    # Auth off (unique_ids): a batch names no project, so an id must name one run.
    with pytest.raises(ValueError, match="another project"):
        batches.register_run(session, RunRegistration(run="r1", project="c"), unique_ids=True)
    with pytest.raises(batches.UnknownRunError, match="run 'r1' exists in projects 'a', 'b'; with auth off"):
        batches.store_batch(session, _steps(0, range(3), seq=1))


def _job(incarnation: int, *, world: int = 2, hidden: int | None = 1024, **kw: object) -> RunRegistration:
    """What the agent sends: every field dumped (so all of them are 'set'), its incarnation."""
    reg = RunRegistration.model_validate({"run": "r1", "incarnation": incarnation, "model": {"hidden": hidden},
                                          "parallelism": {"world_size": world}, **kw})  # fmt: skip
    return RunRegistration.model_validate(reg.model_dump(mode="json"))


def test_a_relaunch_of_the_same_job_is_a_new_incarnation(session) -> None:
    assert batches.register_run(session, _job(1)) is True
    batches.store_batch(session, _steps(0, range(10), seq=0, incarnation=1))
    # Relaunched from step 5 (a crash, a requeue): same model and layout, new incarnation, other
    # batch sizes and checkpoint settings. Accepted; its steps replace the old ones from step 5.
    relaunch = _job(2, parallelism={"world_size": 2, "micro_batch": 4}, checkpoint={"interval_steps": 50})
    assert batches.register_run(session, relaunch) is False
    assert not batches.store_batch(session, _steps(0, range(5, 12), seq=0, incarnation=2)).duplicate
    keys = queries.step_keys(session, run_id="r1")  # (rank, incarnation, step); reads take the newest
    assert {k[1] for k in keys if k[2] < 5} == {1} and {k[1] for k in keys if k[2] >= 10} == {2}
    # A hand-written registration naming nothing but the run contradicts nothing either.
    assert batches.register_run(session, RunRegistration(run="r1")) is False


def test_another_job_reusing_the_run_id_is_refused_with_what_differs(session) -> None:
    batches.register_run(session, _job(1))
    batches.store_batch(session, _steps(0, range(10), seq=0, incarnation=1))
    with pytest.raises(batches.RunConflictError) as refused:
        batches.register_run(session, _job(7, world=4, hidden=2048))
    message = str(refused.value)
    assert message.startswith(
        "run 'r1' is registered for another job (model.hidden: 1024 registered, 2048 now; "
        "parallelism.world_size: 2 registered, 4 now): nothing of this process is stored under it."
    )
    assert "its own run id (attach(run=...) or TRAINVITALS_RUN)" in message and "resume=true" in message
    # The refused process's batches are refused with the same words; the run's own still flow.
    with pytest.raises(batches.RefusedIncarnationError, match="model.hidden: 1024 registered, 2048 now"):
        batches.store_batch(session, _steps(0, range(10), seq=0, incarnation=7))
    session.rollback()
    with pytest.raises(batches.RunConflictError):  # the agent registers again before retrying: same answer
        batches.register_run(session, _job(7, world=4, hidden=2048))
    assert batches.store_batch(session, _steps(1, range(10), seq=0, incarnation=1)).accepted == 20
    assert {k[1] for k in queries.step_keys(session, run_id="r1")} == {1}
    # An older agent that did not derive the model dims is not another job.
    assert batches.register_run(session, _job(8, hidden=None)) is False


def test_an_moe_with_other_experts_is_another_job(session) -> None:
    def moe(incarnation: int, run: str = "m", **experts: int) -> RunRegistration:
        return RunRegistration(run=run, incarnation=incarnation, model={"hidden": 1024, **experts})

    batches.register_run(session, moe(1, experts=8, active_experts=2))
    with pytest.raises(batches.RunConflictError, match=r"model.experts: 8 registered, 16 now\)"):
        batches.register_run(session, moe(2, experts=16, active_experts=2))
    with pytest.raises(batches.RunConflictError, match=r"model.active_experts: 2 registered, 1 now\)"):
        batches.register_run(session, moe(3, experts=8, active_experts=1))
    # Registered without them (an older agent, or one an older collector made drop them): the same job.
    assert batches.register_run(session, moe(4)) is False
    # Shared experts: absent on either side contradicts nothing (an agent of session 47 read none);
    # two widths are two models.
    assert batches.register_run(session, moe(5, experts=8, active_experts=2, shared_ffn_hidden=4096)) is False
    batches.register_run(session, moe(1, "s", experts=8, active_experts=2, shared_ffn_hidden=4096))
    with pytest.raises(batches.RunConflictError, match=r"model.shared_ffn_hidden: 4096 registered, 2048 now\)"):
        batches.register_run(session, moe(2, "s", experts=8, active_experts=2, shared_ffn_hidden=2048))
    assert batches.register_run(session, moe(3, "s", experts=8, active_experts=2)) is False
    # Head width (session 49): the same rule.
    batches.register_run(session, moe(1, "h", head_dim=128))
    with pytest.raises(batches.RunConflictError, match=r"model.head_dim: 128 registered, 64 now\)"):
        batches.register_run(session, moe(2, "h", head_dim=64))
    assert batches.register_run(session, moe(3, "h")) is False
    # An MLA attention core's width (session 50): the same rule.
    batches.register_run(session, moe(1, "c", attention_core_width=20480))
    with pytest.raises(batches.RunConflictError, match=r"model.attention_core_width: 20480 registered, 16384 now\)"):
        batches.register_run(session, moe(2, "c", attention_core_width=16384))
    assert batches.register_run(session, moe(3, "c")) is False


def test_a_declared_resume_continues_the_run_on_a_new_layout(session) -> None:
    batches.register_run(session, _job(1, world=8))
    assert batches.register_run(session, _job(2, world=4, resume=True)) is False
    run = queries.get_run(session, run_id="r1")
    assert run is not None and run.world_size == 4 and run.registration["parallelism"]["world_size"] == 4
    assert batches.store_batch(session, _steps(0, range(3), seq=0, incarnation=2)).accepted == 6
    assert batches.register_run(session, _job(3, world=4)) is False  # its relaunches: the same job now


def test_global_grad_norm_counts_replicas_once(session) -> None:
    batches.register_run(session, RunRegistration(run="r1", parallelism={"world_size": 2}))
    batches.store_batch(session, _steps(0, range(0, 10), seq=0))
    batches.store_batch(session, _steps(1, range(0, 8), seq=0))
    # Replicated DDP gradients: only rank 0 owns them, so the norm is sqrt(4), not sqrt(8).
    assert queries.global_grad_norm(session, run_id="r1", step=5) == pytest.approx(2.0)
    assert session.scalar(select(func.count()).select_from(GradStatRow)) == 18


def test_delete_run_removes_every_record(session) -> None:
    batches.register_run(session, RunRegistration(run="r1"))
    batches.store_batch(session, _steps(0, range(0, 4), seq=0))
    assert queries.delete_run(session, run_id="r1") is True
    assert queries.count_step_rows(session, run_id="r1") == 0
    assert queries.list_runs(session) == []
    assert queries.delete_run(session, run_id="r1") is False


def test_a_big_runs_delete_commits_between_chunks_and_ingest_writes_through(session, monkeypatch) -> None:
    """DELETE /v1/runs/{run} of a big run is many short transactions, not one: on SQLite that one
    held the database's write lock for minutes, and every run's ingest answered 503. Between two
    of them another run's batch is stored; at the end every record of the run is gone."""
    from sqlalchemy import event
    from sqlalchemy.orm import Session

    monkeypatch.setattr(queries, "DELETE_CHUNK_ROWS", 10)
    batches.register_run(session, RunRegistration(run="r1"))
    batches.store_batch(session, _steps(0, range(0, 45), seq=0))
    batches.register_run(session, RunRegistration(run="r2"))
    other = Session(session.get_bind())
    left: list[int] = []

    def ingest_between_chunks(committed: Session) -> None:
        left.append(other.scalar(select(func.count()).select_from(StepRow).where(StepRow.run_id == "r1")) or 0)
        other.commit()
        if len(left) == 2:  # after the first chunk: a writer that one transaction would block
            r2 = _steps(0, range(0, 3), seq=0).model_copy(update={"run": "r2"})
            assert batches.store_batch(other, r2).accepted == 6  # 3 step and 3 grad records

    event.listen(session, "after_commit", ingest_between_chunks)
    try:
        assert queries.delete_run(session, run_id="r1") is True
    finally:
        event.remove(session, "after_commit", ingest_between_chunks)
        other.close()
    assert left[:6] == [45, 35, 25, 15, 5, 0] and left[-1] == 0
    assert queries.count_step_rows(session, run_id="r1") == 0
    assert session.scalar(select(func.count()).select_from(GradStatRow).where(GradStatRow.run_id == "r1")) == 0
    assert [r.run_id for r in queries.list_runs(session)] == ["r2"]
    assert queries.count_step_rows(session, run_id="r2") == 3


def test_a_deleted_runs_counts_leave_it_and_stay_in_the_collectors_totals(session) -> None:
    """Its ingest counters stayed under its id: the run registered again under it (a replay after
    the delete) was shown the old records with its own. Deleted, the collector-wide batch counter
    (a Prometheus counter) would go down: they are kept there, under no run."""

    def totals() -> dict[str, int]:
        out: dict[str, int] = {}
        for row in queries.ingest_counts(session):
            out[row.outcome] = out.get(row.outcome, 0) + row.batches
        return out

    batches.register_run(session, RunRegistration(run="r1"))
    batches.store_batch(session, _steps(0, range(0, 4), seq=0))
    batches.store_batch(session, _steps(0, range(0, 4), seq=0))  # a duplicate
    before = totals()
    assert before == {"stored": 1, "duplicate": 1}
    assert queries.delete_run(session, run_id="r1") is True
    assert totals() == before
    batches.register_run(session, RunRegistration(run="r1"))
    overview = queries.run_overview(session, run_id="r1")
    assert overview is not None and overview.step_records == 0
    batches.store_batch(session, _steps(0, range(0, 2), seq=0))
    overview = queries.run_overview(session, run_id="r1")
    assert overview is not None and overview.step_records == 2
    assert totals() == {"stored": 2, "duplicate": 1}


def _fp8_batch(rank: int, values: list[dict[str, object]]) -> dict[str, object]:
    records = [
        {"kind": "tensor", "step": i, "tensor": f"layers.{i}.fc", "role": "input", "format": "e4m3", **v}
        for i, v in enumerate(values)
    ]
    records.append({"kind": "grad", "step": 0, "group": "layers.0", "owned_sq": 1.5, "local_sq": 2.5, "nonfinite": 1})
    return {"run": "r1", "rank": rank, "incarnation": 1, "seq": 0, "records": records}


def test_the_routes_structs_and_pydantic_batches_become_the_same_rows() -> None:
    """The route's msgspec structs are read as rows in one C call (their fields are the columns,
    in order); pydantic batches by attribute name: the same body must give the same rows."""
    body = _fp8_batch(3, [{"amax": 3.0, "scale": 2.0, "shadow": True}, {"amax": 1.0, "sat_frac": 0.5}])
    body["records"].append({"kind": "step", "step": 1, "ts": 100.0, "step_seconds": 0.5, "loss": 2.0})
    body["records"].append(
        {"kind": "event", "step": 1, "ts": 100.0, "event": "stop", "detail": "done", "domains": {"node": "n1"}}
    )
    fast = decode_batch(json.dumps(body).encode())
    assert batches.batch_rows(fast) == batches.batch_rows(Batch.model_validate(body))


def test_a_kind_interleaved_with_others_keeps_its_records_order_in_its_rows() -> None:
    """Rows are built by runs of one record type: a kind that comes back after other kinds (as
    an agent's batch of several steps does) continues its rows where it stopped, in record order."""
    body = _fp8_batch(2, [{"amax": 1.0}, {"amax": 2.0}])
    step = {"kind": "step", "step": 0, "ts": 100.0, "step_seconds": 0.5}
    checkpoint = {"kind": "checkpoint", "step": 0, "ts": 100.0, "generation": 1, "path": "/ck/1", "status": "started"}
    tensor = {"kind": "tensor", "step": 1, "tensor": "layers.9.fc", "role": "weight", "format": "e4m3", "amax": 9.0}
    # tensor, tensor, grad (from _fp8_batch), then step, tensor, checkpoint, tensor, step
    body["records"] += [step, tensor, checkpoint, {**tensor, "amax": 10.0}, {**step, "step": 1}]
    for batch in (decode_batch(json.dumps(body).encode()), Batch.model_validate(body)):
        fast, other, low = batches.batch_rows(batch)
        width = batches._WIDTH
        rows = {k: [tuple(flat[i : i + width[k]]) for i in range(0, len(flat), width[k])] for k, flat in fast.items()}
        tensors = [("layers.0.fc", 1.0), ("layers.1.fc", 2.0), ("layers.9.fc", 9.0), ("layers.9.fc", 10.0)]
        assert [(r[4], r[7]) for r in rows["tensor"]] == tensors  # (tensor, amax) after prefix, step
        assert [r[3] for r in rows["step"]] == [0, 1]  # step follows (run_id, rank, incarnation)
        assert all(r[:3] == ("r1", 2, 1) for kind_rows in rows.values() for r in kind_rows)
        assert [row["path"] for row in other["checkpoint"]] == ["/ck/1"]
        assert len(rows["grad"]) == 1 and low == 0 and set(fast) == {"tensor", "grad", "step"}


def test_nan_is_stored_as_nan_and_infinities_as_themselves_on_both_backends(session) -> None:
    """SQLite gets NaN as text (a NaN REAL would be NULL): the check runs on each REAL column of a
    statement's parameters at once. A column holding inf and -inf sums to NaN too: those must still
    be stored as the infinities they are."""
    batches.register_run(session, RunRegistration(run="r1"))
    nan, inf = float("nan"), float("inf")
    values = [{"amax": 1.0 + i, "scale": 2.0} for i in range(40)]
    values[17] = {"amax": nan, "scale": 2.0, "crest_bits": nan}
    values[30] = {"amax": 3.0, "scale": inf}
    values[31] = {"amax": 3.0, "scale": -inf, "underflow_frac": 0.25}
    assert batches.store_batch(session, Batch.model_validate(_fp8_batch(0, values))).accepted == 41
    rows = session.execute(
        select(TensorStatRow.step, TensorStatRow.amax, TensorStatRow.scale, TensorStatRow.crest_bits,
               TensorStatRow.underflow_frac).order_by(TensorStatRow.step)
    ).all()  # fmt: skip
    assert len(rows) == 40
    assert math.isnan(rows[17].amax) and math.isnan(rows[17].crest_bits)
    assert (rows[30].scale, rows[31].scale, rows[31].underflow_frac) == (inf, -inf, 0.25)
    assert [r.amax for i, r in enumerate(rows) if i != 17] == [
        3.0 if i in (30, 31) else 1.0 + i for i in range(40) if i != 17
    ]
    assert all(r.crest_bits is None for i, r in enumerate(rows) if i != 17)


def test_columns_empty_in_a_chunk_are_written_as_null_and_the_others_keep_their_values(session) -> None:
    """On SQLite a nullable column that is None in every row of a statement's chunk is written as a
    literal NULL and left out of the bound parameters (`_chunk_params`). 300 rows go in chunks of
    256, 32 and 12; each optional statistic is present in different chunks, one in none, one in all:
    every stored value must be the one sent, in its own column."""
    batches.register_run(session, RunRegistration(run="r1"))
    values: list[dict[str, object]] = []
    for i in range(300):
        v: dict[str, object] = {"amax": 1.0 + i, "scale": 2.0, "lag_bits": 0.5}  # lag_bits: in every row
        if i < 256:
            v["crest_bits"] = 10.0 + i  # the first chunk only
        if 256 <= i < 288 or i == 299:
            v["sat_frac"] = 0.001 * i  # the second chunk, and the last row of the last
        if i % 7 == 0:
            v["nonfinite"] = i  # scattered: present in some rows of most chunks
        values.append(v)  # underflow_frac: in no row
    assert batches.store_batch(session, Batch.model_validate(_fp8_batch(0, values))).accepted == 301
    t = TensorStatRow
    rows = session.execute(
        select(t.step, t.amax, t.lag_bits, t.crest_bits, t.sat_frac, t.nonfinite, t.underflow_frac).order_by(t.step)
    ).all()
    got = [tuple(r) for r in rows]
    want = [
        (i, v["amax"], v["lag_bits"], v.get("crest_bits"), v.get("sat_frac"), v.get("nonfinite"), None)
        for i, v in enumerate(values)
    ]
    assert got == want


def test_a_chunks_constant_columns_keep_each_rows_value_across_runs_and_flags(session) -> None:
    """On SQLite a BOOLEAN column that is the same in every row of a chunk is written as a literal,
    and a run key the same in every row is bound once (`_chunk_params`). A group of two runs'
    batches mixes both in one chunk: r1's 10 rows all shadowed, r2's 6 all not (16 rows, one
    statement holding both keys and both flags); then r1 alone in chunks of 256, 32 and 12 whose
    shadow flags are all set, all clear and mixed. Every stored row must keep its own run and flag."""
    for run in ("r1", "r2"):
        batches.register_run(session, RunRegistration(run=run))

    def batch(run: str, seq: int, shadows: list[bool]) -> Batch:
        body = _fp8_batch(0, [{"amax": 1.0 + i, "shadow": s} for i, s in enumerate(shadows)])
        body["records"] = body["records"][:-1]  # tensors only
        return Batch.model_validate({**body, "run": run, "seq": seq})

    mixed_group = [(batch("r1", 0, [True] * 10), None), (batch("r2", 0, [False] * 6), None)]
    assert [o.accepted for o in batches.store_batches(session, mixed_group)] == [10, 6]
    alone = [True] * 256 + [False] * 32 + [i % 3 == 0 for i in range(12)]
    assert batches.store_batch(session, batch("r1", 1, alone)).accepted == 300
    t = TensorStatRow
    rows = session.execute(select(t.run_id, t.shadow, t.amax).order_by(t.id)).all()
    want = [("r1", True, 1.0 + i) for i in range(10)] + [("r2", False, 1.0 + i) for i in range(6)]
    want += [("r1", s, 1.0 + i) for i, s in enumerate(alone)]
    assert [tuple(r) for r in rows] == want
