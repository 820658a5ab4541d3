"""store_batch: atomic, idempotent, on SQLite and PostgreSQL."""

import pytest
from sqlalchemy import func, select

from trainvitals.service.store import batches, queries
from trainvitals.service.store.models import DeliveredBatch, GradStatRow, StepRow
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
    return Batch.model_validate(
        {"run": "r1", "rank": rank, "incarnation": incarnation, "seq": seq, "records": records}
    )


def test_batches_are_stored_once(session) -> None:
    batches.register_run(session, RunRegistration(run="r1", parallelism={"world_size": 2}))
    first = batches.store_batch(session, _steps(0, range(0, 10), seq=0))
    again = batches.store_batch(session, _steps(0, range(0, 10), seq=0))
    batches.store_batch(session, _steps(1, range(0, 10), seq=0))
    assert (first.accepted, first.duplicate) == (20, False)
    assert (again.accepted, again.duplicate) == (0, True)
    assert queries.count_step_rows(session, run_id="r1") == 20
    assert session.scalar(select(func.count()).select_from(DeliveredBatch)) == 2


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


def test_registration_is_idempotent_and_project_bound(session) -> None:
    assert batches.register_run(session, RunRegistration(run="r1", project="a")) is True
    assert batches.register_run(session, RunRegistration(run="r1", project="a")) is False
    with pytest.raises(ValueError, match="project"):
        batches.register_run(session, RunRegistration(run="r1", project="b"))


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
