"""The collector's analysis loop for one run: reduce new raw rows into summaries, build the
detector inputs from the summaries, run the detectors, store their findings.

Live, a background worker calls `process_run` every few seconds for every live run; offline,
`trainvitals replay` calls it once at the end: the same code, so results are identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Integer, delete, func, insert, select
from sqlalchemy.orm import Session

from trainvitals.service.analysis import reduction
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.store.models import (
    FindingRow,
    GradStatRow,
    GradSummary,
    RankWindow,
    ReductionState,
    Run,
    StepRow,
    StepSummary,
    TensorStatRow,
    TensorSummary,
)
from trainvitals.service.store.queries import GLOBAL_GROUP


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineConfig:
    settle_seconds: float = 30.0
    """A step is reduced once every rank sent it, or once it is this old (a rank may be dead)."""
    rank_window_steps: int = 50
    """Steps per rank window (the straggler view)."""
    detector_lookback_steps: int = 20_000
    """Detectors see at most this many recent steps (bounded work per cycle)."""
    straggler_lookback_steps: int = 600
    """Per-rank per-step timing the straggler detectors see (12 windows of 50 steps)."""
    detector_warmup_steps: int = 300
    """Steps from the run's start during which detectors stay quiet (LR warm-up, early loss drop)."""


def peak_flops_total(registration: dict[str, Any]) -> float | None:
    hw = registration.get("hardware") or {}
    count = hw.get("gpu_count") or (registration.get("parallelism") or {}).get("world_size")
    peak = hw.get("peak_flops")
    if peak is None and hw.get("gpu_type"):
        from trainvitals.service.advisors.hardware import gpu_spec

        try:
            peak = gpu_spec(str(hw["gpu_type"])).peak_bf16_tflops * 1e12
        except ValueError:  # 'cpu' or an unknown type: no MFU without a declared peak
            peak = None
    return float(peak) * int(count) if peak and count else None


def _state(session: Session, run_id: str) -> ReductionState:
    state = session.get(ReductionState, run_id)
    if state is None:
        state = ReductionState(run_id=run_id, reduced_upto=-1, dirty_from=None)
        session.add(state)
        session.flush()
    return state


def _reduce_upto(session: Session, run: Run, start: int, now: float, settle: float) -> int:
    """Newest step up to which every rank has reported (low watermark), or older than the settle
    time. Reads only steps >= start: the cost of a cycle follows the new rows, not the run's length."""
    rid = run.run_id
    if run.status == "finished":
        newest = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == rid))
        return start - 1 if newest is None else int(newest)
    watermark = start - 1
    for step, ranks in session.execute(
        select(StepRow.step, func.count(func.distinct(StepRow.rank)))
        .where(StepRow.run_id == rid, StepRow.step >= start)
        .group_by(StepRow.step)
        .order_by(StepRow.step)
    ):
        if ranks < run.world_size:
            break
        watermark = step
    settled = session.scalar(
        select(func.max(StepRow.step)).where(StepRow.run_id == rid, StepRow.step >= start, StepRow.ts <= now - settle)
    )
    return max(watermark, settled if settled is not None else -1)


def reduce_run(session: Session, run: Run, *, now: float, config: PipelineConfig = PipelineConfig()) -> int:
    """Reduce not-yet-reduced (or re-dirtied) steps; returns how many steps were (re)written."""
    return reduce_steps(session, run, now=now, config=config)[0]


def reduce_steps(session: Session, run: Run, *, now: float, config: PipelineConfig) -> tuple[int, int | None]:
    """(steps (re)written, the first step whose stored rows changed since the last cycle or None).

    Late rows for reduced steps that cannot be reduced again yet (the watermark has not reached
    them) still count as changed: the detectors' per-rank timing reads raw rows."""
    state = _state(session, run.run_id)
    start = state.reduced_upto + 1
    if state.dirty_from is not None:
        start = min(start, state.dirty_from)
    upto = _reduce_upto(session, run, start, now, config.settle_seconds)
    if upto < start:
        session.commit()
        return 0, state.dirty_from
    # Whole rank windows are recomputed, so read from the start of the first touched window.
    w = config.rank_window_steps
    read_from = min(start, start // w * w)
    rows = [
        reduction.StepIn(*r)
        for r in session.execute(
            select(
                StepRow.step,
                StepRow.rank,
                StepRow.incarnation,
                StepRow.ts,
                StepRow.step_seconds,
                StepRow.compute_seconds,
                StepRow.wait_seconds,
                StepRow.data_seconds,
                StepRow.loss,
                StepRow.tokens,
                StepRow.flops,
                StepRow.grad_norm,
                StepRow.pp_stage,
            ).where(StepRow.run_id == run.run_id, StepRow.step >= read_from, StepRow.step <= upto)
        )
    ]
    in_range = [r for r in rows if r.step >= start]
    keep = _keep_set(in_range)
    grads = reduction.summarize_grads(
        session.execute(
            select(
                GradStatRow.step,
                GradStatRow.rank,
                GradStatRow.incarnation,
                GradStatRow.group_name,
                GradStatRow.owned_sq,
                GradStatRow.local_sq,
                GradStatRow.nonfinite,
            ).where(GradStatRow.run_id == run.run_id, GradStatRow.step >= start, GradStatRow.step <= upto)
        ).all(),
        keep,
    )
    global_norms = {g["step"]: (g["norm"], g["nonfinite"]) for g in grads if g["group_name"] == GLOBAL_GROUP}
    steps = reduction.summarize_steps(
        in_range, peak_flops_total=peak_flops_total(run.registration), agent_grad_norms=global_norms
    )
    windows = reduction.summarize_rank_windows(rows, window=w)
    tensors = _tensor_summaries(session, run.run_id, start, upto)

    rid = run.run_id
    conn = session.connection()  # Core statements: the ORM bulk path costs ~3x more per row
    for model, lo in ((StepSummary, start), (GradSummary, start), (TensorSummary, start), (RankWindow, read_from)):
        table = model.__table__
        col = table.c.window_start if model is RankWindow else table.c.step
        conn.execute(delete(table).where(table.c.run_id == rid, col >= lo, col <= upto))
    for model, batch in ((StepSummary, steps), (GradSummary, grads), (TensorSummary, tensors), (RankWindow, windows)):
        if batch:
            conn.execute(insert(model.__table__), [{"run_id": rid, **row} for row in batch])
    state.reduced_upto = max(state.reduced_upto, upto)
    state.dirty_from = None
    session.commit()
    return len(steps), start


def _keep_set(rows: list[reduction.StepIn]) -> set[tuple[int, int, int]] | None:
    """None when no (rank, step) has two incarnations (the common case: no filtering needed)."""
    seen: dict[tuple[int, int], int] = {}
    dup = False
    for r in rows:
        key = (r.rank, r.step)
        if key in seen:
            dup = True
            seen[key] = max(seen[key], r.incarnation)
        else:
            seen[key] = r.incarnation
    return {(rank, step, inc) for (rank, step), inc in seen.items()} if dup else None


def _tensor_summaries(session: Session, run_id: str, start: int, upto: int) -> list[dict[str, Any]]:
    # Reduced in SQL: max amax / min headroom over ranks and TP shards of the same tensor.
    t = TensorStatRow
    rows = session.execute(
        select(
            t.step,
            t.tensor,
            t.role,
            func.max(t.format),
            func.max(t.amax),
            func.min(t.headroom_bits),
            func.max(t.lag_bits),
            func.max(t.staleness_steps),
            func.max(t.sat_frac),
            func.max(t.underflow_frac),
            func.max(t.crest_bits),
            func.sum(t.nonfinite),
            func.min(func.cast(t.shadow, Integer)),
        )
        .where(t.run_id == run_id, t.step >= start, t.step <= upto)
        .group_by(t.step, t.tensor, t.role)
    ).all()
    keys = (
        "step",
        "tensor",
        "role",
        "format",
        "amax",
        "headroom_bits",
        "lag_bits",
        "staleness_steps",
        "sat_frac",
        "underflow_frac",
        "crest_bits",
        "nonfinite",
        "shadow",
    )
    out = []
    for r in rows:
        d = dict(zip(keys, r, strict=True))
        d["shadow"] = bool(d["shadow"])
        out.append(d)
    return out


# --------------------------------------------------------------------------- detector inputs


def build_series(
    session: Session,
    run: Run,
    *,
    now: float,
    config: PipelineConfig = PipelineConfig(),
    inputs: DetectorInputs | None = None,
    rewritten_from: int | None = None,
) -> Any:
    """RunSeries (the detectors' input) from the summary tables, over the recent lookback.

    inputs: what an earlier cycle read for this run (the worker keeps one per run); None reads
    the whole lookback. rewritten_from: the first step this cycle's reduction (re)wrote.
    """
    inputs = DetectorInputs() if inputs is None else inputs
    return inputs.build(
        session,
        run,
        rewritten_from=rewritten_from,
        now=now,
        lookback_steps=config.detector_lookback_steps,
        rank_lookback_steps=config.straggler_lookback_steps,
        peak_flops_total=peak_flops_total(run.registration),
    )


# --------------------------------------------------------------------------- findings


def store_findings(session: Session, run_id: str, findings: list[Any], *, now: float) -> None:
    """Upsert by (run, kind, subject); the detector says which are active; findings it no longer
    reports at all become inactive."""
    existing = {
        (f.kind, f.subject_kind, f.subject): f
        for f in session.scalars(select(FindingRow).where(FindingRow.run_id == run_id))
    }
    seen = set()
    for f in findings:
        key = (f.kind, f.subject_kind, f.subject)
        seen.add(key)
        active = bool(f.active)
        row = existing.get(key)
        if row is None:
            session.add(
                FindingRow(
                    run_id=run_id,
                    kind=f.kind,
                    severity=f.severity,
                    subject_kind=f.subject_kind,
                    subject=f.subject,
                    onset_step=f.onset_step,
                    last_step=f.last_step,
                    magnitude=float(f.magnitude),
                    summary=f.summary,
                    active=active,
                    first_seen_at=now,
                    updated_at=now,
                )
            )
        else:
            row.severity, row.onset_step, row.last_step = f.severity, f.onset_step, f.last_step
            row.magnitude, row.summary, row.active, row.updated_at = (
                float(f.magnitude),
                f.summary,
                active,
                now,
            )
    for key, row in existing.items():
        if key not in seen and row.active:
            row.active = False
            row.updated_at = now
    session.commit()


def process_run(
    session: Session,
    run: Run,
    *,
    now: float | None = None,
    config: PipelineConfig = PipelineConfig(),
    inputs: DetectorInputs | None = None,
) -> int:
    """Reduce, detect, store findings. Returns the number of steps reduced.

    inputs: the run's detector inputs kept from the previous cycle (live worker); None: read them whole.
    """
    now = time.time() if now is None else now
    reduced, first = reduce_steps(session, run, now=now, config=config)
    from trainvitals.service.detectors.run_all import DetectorConfig, detect
    from trainvitals.service.detectors.suppression import SuppressionConfig

    series = build_series(session, run, now=now, config=config, inputs=inputs, rewritten_from=first)
    detector_config = DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
    store_findings(session, run.run_id, detect(series, config=detector_config), now=now)
    return reduced
