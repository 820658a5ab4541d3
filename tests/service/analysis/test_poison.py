"""One run's records cannot stop its analysis, nor another run's: every value the wire accepts is
reduced (the extremes of every range), and a run whose analysis fails anyway is isolated, reported
as a finding and on /metrics, and named in the log every time."""

from __future__ import annotations

import logging
import sys

import pytest
from sqlalchemy import select, update

from trainvitals.service.analysis import on_request
from trainvitals.service.analysis.worker import AnalysisWorker
from trainvitals.service.exposition import TrainvitalsCollector, make_registry
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db, queries
from trainvitals.service.store.findings import ANALYSIS_FAILED
from trainvitals.service.store.models import FindingRow, GradSummary, Run, StepSummary, TensorSummary
from trainvitals.wire import Batch, RunRegistration
from trainvitals.wire.v1 import INT32_MAX, INT64_MAX, MAX_STEP

BIG = sys.float_info.max
NOW = 10_000.0


@pytest.fixture
def maker(db_url: str):
    engine = db.make_engine(db_url)
    yield db.make_sessionmaker(engine)
    engine.dispose()


def _records(rank: int, steps: list[int]) -> list[dict]:
    """Records at the edges of the wire's ranges: all accepted, several unsummable naively."""
    out: list[dict] = []
    for s in steps:
        out.append({"kind": "step", "step": s, "ts": 100.0 + (s % 1000), "step_seconds": BIG,
                    "compute_seconds": BIG, "loss": float("inf") if rank else float("nan"), "tokens": INT64_MAX,
                    "flops": BIG, "grad_norm": float("nan"), "pp_stage": INT32_MAX, "tp_rank": INT32_MAX,
                    "dp_rank": INT32_MAX})  # fmt: skip
        out.append({"kind": "tensor", "step": s, "tensor": "fc", "role": "input", "format": "e4m3",
                    "amax": float("inf"), "headroom_bits": float("-inf"), "staleness_steps": INT32_MAX,
                    "nonfinite": INT64_MAX, "sat_frac": 1.0})  # fmt: skip
        out.append({"kind": "grad", "step": s, "group": "__global__", "owned_sq": BIG, "local_sq": float("inf"),
                    "nonfinite": INT64_MAX})  # fmt: skip
    out.append({"kind": "checkpoint", "step": steps[-1], "generation": INT32_MAX, "status": "persisted",
                "ts": 100.0, "bytes": INT64_MAX, "stall_seconds": BIG})  # fmt: skip
    return out


def _store(maker, run: str, records_of_rank, *, world: int = 2) -> None:
    with maker() as session:
        batches.register_run(session, RunRegistration(
            run=run, parallelism={"world_size": world},
            hardware={"gpu_count": world, "peak_flops": BIG}), now=NOW)  # fmt: skip
        for rank in range(world):
            body = {"run": run, "rank": rank, "incarnation": INT64_MAX, "seq": INT64_MAX,
                    "records": records_of_rank(rank)}  # fmt: skip
            batches.store_batch(session, Batch.model_validate(body), now=NOW)


def _failure_of(run: str):
    return select(FindingRow).where(FindingRow.run_id == run, FindingRow.kind == ANALYSIS_FAILED)


def _healthy(rank: int) -> list[dict]:
    return [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0, "loss": 2.0} for s in range(20)]


def test_the_extremes_of_every_range_are_reduced(maker, db_url: str) -> None:
    """Two ranks at the top of every range (non-finite counts near 2**63 overflowed a SQL sum on
    SQLite; an Infinity step time broke the stage-median JSON write on PostgreSQL), and a step at
    the largest the wire takes, far after the others: the run is analysed, nothing fails."""
    _store(maker, "edge", lambda rank: _records(rank, [0, 1, 2, MAX_STEP]))
    _store(maker, "ok", _healthy, world=1)
    worker = AnalysisWorker(maker, Settings(db=db_url), clock=lambda: NOW)
    worker.run_once()
    assert worker.errors == 0
    with maker() as session:
        steps = session.scalars(select(StepSummary).where(StepSummary.run_id == "edge")).all()
        assert [s.step for s in steps] == [0, 1, 2, MAX_STEP]
        assert steps[0].step_seconds_max == BIG and steps[0].grad_nonfinite == INT64_MAX
        nonfinite = session.scalars(select(TensorSummary.nonfinite).where(TensorSummary.run_id == "edge")).all()
        assert nonfinite == [INT64_MAX] * 4  # saturated: 2 x (2**63 - 1) does not fit the column
        grads = session.scalars(select(GradSummary.nonfinite).where(GradSummary.run_id == "edge")).all()
        assert grads == [INT64_MAX] * 4
        assert session.scalar(select(StepSummary.step).where(StepSummary.run_id == "ok").order_by(
            StepSummary.step.desc()).limit(1)) == 19  # fmt: skip
        kinds = session.scalars(select(FindingRow.kind).where(FindingRow.run_id == "edge")).all()
        assert ANALYSIS_FAILED not in kinds and "loss_nonfinite" in kinds
        # The analysis on request walks the same history: its cycles skip the gap too.
        asked = on_request.analyse_run(session, queries.get_run(session, run_id="edge"))
        assert "loss_nonfinite" in {f.kind for f in asked}


def test_a_run_whose_analysis_fails_is_reported_and_the_others_are_analysed(
    maker, db_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    _store(maker, "bad", _healthy, world=1)
    _store(maker, "good", _healthy, world=1)
    # A stored registration the analysis cannot read (an older collector, a hand edit): a real
    # failure inside process_run, every cycle, until it is fixed.
    with maker() as session:
        registration = session.get(Run, "bad").registration
        broken = {**registration, "hardware": {"gpu_count": 1, "peak_flops": "fast"}}
        session.execute(update(Run).where(Run.run_id == "bad").values(registration=broken))
        session.commit()
    now = [NOW]
    worker = AnalysisWorker(maker, Settings(db=db_url), clock=lambda: now[0])
    registry = make_registry(TrainvitalsCollector(maker, Settings(db=db_url), clock=lambda: now[0]))
    with caplog.at_level(logging.ERROR, logger="trainvitals.service"):
        for _ in range(3):
            worker.run_once()
            now[0] += 5
    # Named in the log at every failure, the traceback only once (the error did not change).
    lines = [r for r in caplog.records if "run bad" in r.getMessage()]
    assert len(lines) == 3 and [r.exc_info is not None for r in lines] == [True, False, False]
    assert "3 in a row" in lines[-1].getMessage() and "ValueError" in lines[-1].getMessage()
    assert not [r for r in caplog.records if "run good" in r.getMessage()]
    # The other run was analysed every cycle.
    with maker() as session:
        assert session.scalar(select(StepSummary.step).where(StepSummary.run_id == "good").order_by(
            StepSummary.step.desc()).limit(1)) == 19  # fmt: skip
        finding = session.scalars(_failure_of("bad")).one()
    assert (finding.kind, finding.severity, finding.active, finding.magnitude) == (ANALYSIS_FAILED, "ticket", True, 3)
    assert finding.onset_step == 0 and "ValueError" in finding.summary
    labels = {"run": "bad", "kind": ANALYSIS_FAILED, "subject_kind": "run", "subject": ""}
    assert registry.get_sample_value("trainvitals_finding_active", {**labels, "severity": "ticket"}) == 1
    assert registry.get_sample_value("trainvitals_finding_magnitude", labels) == 3
    assert registry.get_sample_value("trainvitals_analysis_errors_total") == 3
    # Fixed: the next cycle analyses the run, and its failure finding closes.
    with maker() as session:
        session.execute(update(Run).where(Run.run_id == "bad").values(registration=registration))
        session.commit()
    worker.run_once()
    with maker() as session:
        finding = session.scalars(_failure_of("bad")).one()
        assert not finding.active
        assert session.scalar(select(StepSummary.step).where(StepSummary.run_id == "bad").order_by(
            StepSummary.step.desc()).limit(1)) == 19  # fmt: skip
    assert registry.get_sample_value("trainvitals_finding_active", {**labels, "severity": "ticket"}) is None
