"""Reduction across ranks into summaries: incarnations, late data, watermarks, TP amax."""

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sqlalchemy import func, select

from trainvitals.service.analysis import pipeline
from trainvitals.service.store import batches, db, detector_blocks, queries, summaries
from trainvitals.service.store.models import GradSummary, RankWindow, StepRow, StepSummary, TensorSummary
from trainvitals.wire import Batch, RunRegistration


def _batch(rank: int, seq: int, steps: range, *, inc: int = 1, seconds: float = 1.0, **extra: object) -> Batch:
    recs: list[dict] = []
    for s in steps:
        recs.append({"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": seconds, "loss": float(inc),
                     "tokens": 10, "flops": 1e9})
        recs.append({"kind": "grad", "step": s, "group": "__global__", "owned_sq": 1.0, "local_sq": 1.0})
        recs.append({"kind": "tensor", "step": s, "tensor": "layers.0.fc", "role": "input", "format": "e4m3",
                     "amax": float(rank + 1), "headroom_bits": 3.0 - rank})
    return Batch.model_validate({"run": "r", "rank": rank, "incarnation": inc, "seq": seq, "records": recs})


def _register(session, world: int = 2) -> None:
    batches.register_run(session, RunRegistration(
        run="r", parallelism={"world_size": world}, hardware={"gpu_count": world, "peak_flops": 1e10}))


def _reduce(session, now: float = 1e9) -> int:
    return pipeline.reduce_run(session, queries.get_run(session, run_id="r"), now=now)


def test_watermark_waits_for_every_rank_then_reduces(session) -> None:
    _register(session)
    batches.store_batch(session, _batch(0, 0, range(10)))
    batches.store_batch(session, _batch(1, 0, range(6), seconds=2.0))
    assert _reduce(session, now=105.0) == 6  # steps 0..5: both ranks; 6..9 are not settled yet
    rows = session.scalars(select(StepSummary).order_by(StepSummary.step)).all()
    assert [r.step for r in rows] == list(range(6))
    s = rows[0]
    assert (s.ranks, s.step_seconds_max, s.slowest_rank, s.tokens) == (2, 2.0, 1, 20)
    assert s.agent_grad_norm == pytest.approx(2**0.5)  # owned squares summed over ranks
    assert s.mfu == pytest.approx(2e9 / (2.0 * 2e10))  # job FLOPs / (slowest time x total peak)
    t = session.scalars(select(TensorSummary).where(TensorSummary.step == 0)).one()
    assert (t.amax, t.headroom_bits) == (2.0, 2.0)  # amax: max over ranks; headroom: min
    assert _reduce(session, now=1e9) == 4  # much later: steps 6..9 settle with the rank that sent them


@pytest.mark.parametrize(("world", "waits"), [(2, 30.0), (16_384, 32.0 + pipeline.SETTLE_MARGIN_S)])
def test_a_step_waits_for_its_missing_ranks_one_send_interval_of_the_run_at_least(session, world, waits) -> None:
    """A 16,384-rank job's ranks send every 32 s (the agent's automatic interval): a step one rank
    sent is not reduced without the others at the configured 30 s, only once a whole interval (and
    the margin) has passed; a small job keeps the configured settle time."""
    _register(session, world=world)
    batches.store_batch(session, _batch(0, 0, range(1)))  # step 0, ts 100.0, one rank of `world`
    assert pipeline.settle_seconds_for(queries.get_run(session, run_id="r"), pipeline.PipelineConfig()) == waits
    assert _reduce(session, now=100.0 + waits - 0.5) == 0
    assert _reduce(session, now=100.0 + waits + 0.5) == 1


def test_restart_keeps_the_newest_incarnation(session) -> None:
    _register(session, world=1)
    batches.store_batch(session, _batch(0, 0, range(10), inc=1))
    _reduce(session)
    batches.store_batch(session, _batch(0, 0, range(5, 12), inc=2))  # resumed from step 5
    assert _reduce(session) == 7  # steps 5..11 re-reduced (late data re-dirtied them)
    losses = dict(session.execute(select(StepSummary.step, StepSummary.loss)).all())
    assert losses[4] == 1.0 and losses[5] == 2.0 and losses[11] == 2.0
    grads = dict(session.execute(select(GradSummary.step, GradSummary.norm)).all())
    assert grads[7] == pytest.approx(1.0)  # not sqrt(2): the old incarnation's row is not counted


def test_rank_windows_and_late_rank(session) -> None:
    _register(session)
    batches.store_batch(session, _batch(0, 0, range(60)))
    _reduce(session)
    batches.store_batch(session, _batch(1, 0, range(60), seconds=3.0))  # the other rank arrives late
    _reduce(session)
    windows = session.execute(select(RankWindow.window_start, RankWindow.rank, RankWindow.steps,
                                     RankWindow.step_seconds_mean)).all()
    assert sorted(windows) == [(0, 0, 50, 1.0), (0, 1, 50, 3.0), (50, 0, 10, 1.0), (50, 1, 10, 3.0)]
    assert session.scalar(select(StepSummary.step_seconds_max).where(StepSummary.step == 3)) == 3.0


def test_nan_is_kept_on_both_backends(session) -> None:
    """A diverging rank sends NaN: SQLite would store a NaN REAL as NULL (losing a batch whose amax
    is NaN to NOT NULL, reading a NaN loss as 'not reported'); both backends keep it, and NaN wins
    max and loses min over ranks alike."""
    _register(session)
    nan = float("nan")
    for rank, (loss, amax, headroom) in enumerate([(nan, nan, nan), (2.5, 3.0, 1.5)]):
        batches.store_batch(session, Batch.model_validate({"run": "r", "rank": rank, "incarnation": 1, "seq": 0,
                                                          "records": [
            {"kind": "step", "step": 0, "ts": 100.0, "step_seconds": 1.0, "loss": loss, "grad_norm": float("inf")},
            {"kind": "grad", "step": 0, "group": "__global__", "owned_sq": nan, "local_sq": nan, "nonfinite": 3},
            {"kind": "tensor", "step": 0, "tensor": "fc", "role": "input", "format": "e4m3", "amax": amax,
             "headroom_bits": headroom},
        ]}))  # fmt: skip
    raw = session.execute(select(StepRow.loss).order_by(StepRow.rank)).scalars().all()
    assert math.isnan(raw[0]) and raw[1] == 2.5
    assert _reduce(session) == 1
    s = session.scalars(select(StepSummary)).one()
    assert (s.loss, s.loss_nonfinite, s.grad_norm, s.grad_nonfinite) == (2.5, 1, float("inf"), 3 * 2)
    t = session.scalars(select(TensorSummary)).one()
    assert math.isnan(t.amax) and t.headroom_bits == 1.5
    g = session.scalars(select(GradSummary).where(GradSummary.group_name == "__global__")).one()
    assert math.isnan(g.norm) and g.nonfinite == 6


def test_a_nan_gradient_norm_the_job_reports_is_a_non_finite_gradient(session) -> None:
    """Without the agent's gradient records (grad_groups='none'), a job's `step(grad_norm=nan)` read
    as "not reported" (NaN and absent are one NaN column): grad_nonfinite stayed 0, and the
    grad_nonfinite page never came. Infinity already counted."""
    _register(session)
    for rank in range(2):
        records = [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0, "grad_norm": norm}
                   for s, norm in enumerate([1.5, float("nan"), None])]  # fmt: skip
        batches.store_batch(session, Batch.model_validate({"run": "r", "rank": rank, "incarnation": 1, "seq": 0,
                                                          "records": records}))  # fmt: skip
    assert _reduce(session) == 3
    rows = session.execute(select(StepSummary.step, StepSummary.grad_norm, StepSummary.grad_nonfinite)
                           .order_by(StepSummary.step)).all()  # fmt: skip
    assert [tuple(r) for r in rows] == [(0, 1.5, 0), (1, None, 1), (2, None, 0)]


def test_a_generation_one_rank_failed_is_a_failed_save_whatever_the_others_recorded(session) -> None:
    """The checkpoint detectors read each rank's record on its own: rank 0's 'persisted' made a
    generation rank 1 failed count as saved (no checkpoint_failed, and a rollback target), where
    the checkpoints query calls it failed. They now read the query's generations."""
    _register(session)
    for rank in range(2):
        saves = [{"kind": "checkpoint", "step": 3, "generation": 1, "status": "persisted", "ts": 103.5},
                 {"kind": "checkpoint", "step": 6, "generation": 2, "status": "failed" if rank else "persisted",
                  "ts": 106.5, **({"error": "rank 1: disk full"} if rank else {})}]  # fmt: skip
        batches.store_batch(session, _batch(rank, 0, range(10)))
        batches.store_batch(session, Batch.model_validate({"run": "r", "rank": rank, "incarnation": 1, "seq": 1,
                                                          "records": saves}))  # fmt: skip
    pipeline.process_run(session, queries.get_run(session, run_id="r"), now=200.0)
    failed = [f for f in queries.findings(session, run_id="r") if f["kind"] == "checkpoint_failed"]
    assert [(f["subject"], f["active"]) for f in failed] == [("2", True)]
    generations = {g["generation"]: g["status"] for g in queries.checkpoint_generations(session, run_id="r")}
    assert generations == {1: "persisted", 2: "failed"}


def test_a_replayed_step_counts_the_newest_incarnations_tensor_records_once(session) -> None:
    """A restart replays steps 5..11 of rank 0: both incarnations' FP8 records of those steps are
    stored. The tensor summary sums non-finite counts over ranks, so it must take rank 0 once, from
    its newest incarnation (and its amax, not the older, larger one)."""
    _register(session)

    def fp8(rank: int, inc: int, steps: range, *, nonfinite: int, amax: float) -> Batch:
        recs: list[dict] = []
        for s in steps:
            recs.append({"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0})
            recs.append({"kind": "tensor", "step": s, "tensor": "layers.0.fc", "role": "input", "format": "e4m3",
                         "amax": amax, "headroom_bits": 1.0, "nonfinite": nonfinite})  # fmt: skip
        return Batch.model_validate({"run": "r", "rank": rank, "incarnation": inc, "seq": 0, "records": recs})

    batches.store_batch(session, fp8(1, 1, range(12), nonfinite=1, amax=1.0))
    batches.store_batch(session, fp8(0, 1, range(10), nonfinite=3, amax=4.0))
    assert _reduce(session) == 12
    batches.store_batch(session, fp8(0, 2, range(5, 12), nonfinite=5, amax=2.0))  # resumed from step 5
    assert _reduce(session) == 7
    t = {s: (n, a) for s, n, a in session.execute(select(TensorSummary.step, TensorSummary.nonfinite,
                                                              TensorSummary.amax))}  # fmt: skip
    assert t[4] == (3 + 1, 4.0)  # not replayed: the first incarnation's
    assert t[7] == (5 + 1, 2.0)  # replayed: the newest incarnation's only (not 3 + 5 + 1, nor amax 4.0)
    assert t[11] == (5 + 1, 2.0)  # rank 0 reached it in its newest incarnation only


def test_a_restart_that_sends_no_fp8_or_gradient_records_leaves_no_summaries_of_the_abandoned_run(session) -> None:
    """Both ranks restart from step 5 with FP8 monitoring and the gradient statistics off: steps
    5..9 ran again without those records, so their FP8 and gradient summaries, which described
    the work the restart threw away, go; steps 0..4, not replayed, keep theirs."""
    _register(session)
    for rank in range(2):
        batches.store_batch(session, _batch(rank, 0, range(10)))
    assert _reduce(session) == 10
    for rank in range(2):
        steps_only = [r for r in _batch(rank, 0, range(5, 10), inc=2).records if r.kind == "step"]
        batches.store_batch(session, Batch(run="r", rank=rank, incarnation=2, seq=0, records=steps_only))
    assert _reduce(session) == 5
    assert sorted(session.scalars(select(TensorSummary.step))) == list(range(5))
    assert sorted(session.scalars(select(GradSummary.step).where(GradSummary.group_name == "__global__"))) == list(
        range(5)
    )
    losses = dict(session.execute(select(StepSummary.step, StepSummary.loss)).all())
    assert [losses[s] for s in (4, 5, 9)] == [1.0, 2.0, 2.0]  # the steps themselves: the newest incarnation's


def test_sqlite_late_data_takes_the_write_lock_after_the_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_lock_probe: Any
) -> None:
    """Late data re-dirties reduced steps, and the reduction deletes the detector blocks that hold
    them. On SQLite that delete takes the one write lock until the commit, so it comes after the
    reads: ingest's writer (another process) never waits through the tensor aggregation."""
    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    probe = write_lock_probe(tmp_path / "tv.db")
    real = summaries.tensor_summaries

    def probing(*args: Any, **kwargs: Any) -> Any:
        probe()
        out = real(*args, **kwargs)
        probe()
        return out

    try:
        with db.make_sessionmaker(engine)() as session:
            _register(session, world=1)
            batches.store_batch(session, _batch(0, 0, range(10)))
            assert _reduce(session) == 10
            payload = detector_blocks.encode({"x": np.zeros(5)})
            detector_blocks.save(session, run_id="r", source="timing", first=5, last=9, payload=payload)
            session.commit()
            batches.store_batch(session, _batch(0, 0, range(5, 12), inc=2))  # restarted: 5..9 again
            monkeypatch.setattr(summaries, "tensor_summaries", probing)
            assert _reduce(session) == 7
            assert detector_blocks.stored(session, run_id="r", source="timing") == set()  # the delete happened
    finally:
        engine.dispose()
    assert probe.locked == [False, False]


def test_a_late_row_below_dropped_raw_rows_keeps_the_summaries_of_the_steps_without_raw_rows(session) -> None:
    """Retention (docs/deployment.md) dropped the raw rows of steps 0-149, then a replay brings
    one rank's step 5 again: the reduction rebuilds the steps that have raw rows (5 and 150-199)
    and keeps the summaries of 6-149, which it cannot rebuild. Step 5 is rebuilt from the late row
    alone: its summary counts one rank."""
    from sqlalchemy import delete

    from trainvitals.service.store.models import GradStatRow, TensorStatRow

    _register(session)
    for rank in range(2):
        batches.store_batch(session, _batch(rank, 0, range(200)))
    assert _reduce(session) == 200
    before = {m: session.scalar(select(func.count()).select_from(m)) for m in _SUMMARIES}
    for raw in (StepRow, GradStatRow, TensorStatRow):
        session.execute(delete(raw).where(raw.step < 150))
    session.commit()
    batches.store_batch(session, _batch(0, 1, range(5, 6)))  # a replayed batch: a new seq
    assert _reduce(session) == 51  # step 5 and 150-199
    steps = dict(session.execute(select(StepSummary.step, StepSummary.ranks)).all())
    assert sorted(steps) == list(range(200))
    assert steps[5] == 1 and all(steps[s] == 2 for s in range(200) if s != 5)
    assert {m: session.scalar(select(func.count()).select_from(m)) for m in _SUMMARIES} == before
    windows = session.execute(select(RankWindow.window_start, RankWindow.rank, RankWindow.steps)).all()
    assert {(w, r): n for w, r, n in windows if w in (50, 100)} == {(w, r): 50 for w in (50, 100) for r in range(2)}


_SUMMARIES = (StepSummary, GradSummary, TensorSummary, RankWindow)


def test_a_high_crest_on_one_rank_is_a_precision_ticket_on_its_tensor(session) -> None:
    """Crest arrives on the agent's expensive steps, is reduced to the worst rank's, reaches the
    detectors through their inputs, and the sustained rise is stored as a ticket on the tensor."""
    _register(session)
    for rank in range(2):
        recs: list[dict] = []
        for s in range(2000):
            recs.append({"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0})
            tensor = {"kind": "tensor", "step": s, "tensor": "layers.0.fc", "role": "input", "format": "e4m3",
                      "amax": 1.0, "headroom_bits": 1.0}  # fmt: skip
            if s % 100 == 0:
                tensor["crest_bits"] = 13.5 if rank == 1 and s >= 1000 else 7.0
            recs.append(tensor)
        batches.store_batch(session, Batch.model_validate({"run": "r", "rank": rank, "incarnation": 1, "seq": 0,
                                                          "records": recs}))  # fmt: skip
    pipeline.process_run(session, queries.get_run(session, run_id="r"), now=1e9)
    (crest,) = [f for f in queries.findings(session, run_id="r") if f["kind"] == "fp8_precision_crest"]
    assert (crest["subject"], crest["severity"], crest["onset_step"]) == ("layers.0.fc:input", "ticket", 1000)
    assert crest["magnitude"] == 13.5 and crest["active"]


def test_flops_of_the_whole_group_on_every_rank_is_an_impossible_mfu_ticket(session) -> None:
    """A tp 2 job whose flops= is the whole group's on both ranks: the collector sums them, MFU reads
    2x. Here it is over 100% of peak, which is said as a miscount, not silently drawn."""
    _register(session)  # 2 ranks, peak 1e10 each, tp not registered
    for rank in range(2):
        recs = [{"kind": "step", "step": s, "ts": 100.0 + s, "step_seconds": 1.0, "tokens": 10, "flops": 1.2e10}
                for s in range(800)]  # fmt: skip
        batches.store_batch(session, Batch.model_validate({"run": "r", "rank": rank, "incarnation": 1, "seq": 0,
                                                          "records": recs}))  # fmt: skip
    pipeline.process_run(session, queries.get_run(session, run_id="r"), now=1e9)
    (f,) = [f for f in queries.findings(session, run_id="r") if f["kind"] == "mfu_impossible"]
    assert (f["severity"], f["magnitude"], f["active"]) == ("ticket", pytest.approx(1.2), True)
    assert f["onset_step"] == 200  # the window that holds the first steps after the warm-up (300 steps)
