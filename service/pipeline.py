"""The collector's analysis loop for one run: reduce new raw rows into summaries, build the
detector inputs from the summaries, run the detectors, store their findings.

Live, a background worker calls `process_run` every few seconds for every live run; offline,
`trainvitals replay` calls it once at the end: the same code, so results are identical.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Integer, delete, func, insert, select
from sqlalchemy.orm import Session

from trainvitals.service import advice, reduce
from trainvitals.service.store.models import (
    CheckpointRow,
    EventRow,
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
    """Newest step every rank has reported (low watermark), or older than the settle time."""
    per_rank = session.execute(
        select(StepRow.rank, func.max(StepRow.step)).where(StepRow.run_id == run.run_id).group_by(StepRow.rank)
    ).all()
    if not per_rank:
        return start - 1
    watermark = min(s for _, s in per_rank) if len(per_rank) >= run.world_size else start - 1
    settled = session.scalar(
        select(func.max(StepRow.step)).where(StepRow.run_id == run.run_id, StepRow.ts <= now - settle)
    )
    if run.status == "finished":
        settled = max(s for _, s in per_rank)
    return max(watermark, settled if settled is not None else -1)


def reduce_run(session: Session, run: Run, *, now: float, config: PipelineConfig = PipelineConfig()) -> int:
    """Reduce not-yet-reduced (or re-dirtied) steps; returns how many steps were (re)written."""
    state = _state(session, run.run_id)
    start = state.reduced_upto + 1
    if state.dirty_from is not None:
        start = min(start, state.dirty_from)
    upto = _reduce_upto(session, run, start, now, config.settle_seconds)
    if upto < start:
        session.commit()
        return 0
    # Whole rank windows are recomputed, so read from the start of the first touched window.
    w = config.rank_window_steps
    read_from = min(start, start // w * w)
    rows = [
        reduce.StepIn(*r)
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
    grads = reduce.summarize_grads(
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
    steps = reduce.summarize_steps(
        in_range, peak_flops_total=peak_flops_total(run.registration), agent_grad_norms=global_norms
    )
    windows = reduce.summarize_rank_windows(rows, window=w)
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
    return len(steps)


def _keep_set(rows: list[reduce.StepIn]) -> set[tuple[int, int, int]] | None:
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


def _rank_steps(session: Session, run_id: str, *, reduced_upto: int | None, lookback: int) -> Any:
    """Per-step x per-rank timing matrices over the recent `lookback` reduced steps (the straggler
    detectors window them themselves and need per-step tails for intermittent slowness). Memory is
    lookback x ranks x 3 floats: 600 x 16,384 ~ 236 MB, so keep the lookback modest at that scale."""
    from trainvitals.service.detectors.series import RankSteps

    if reduced_upto is None:
        return None
    rows = session.execute(
        select(
            StepRow.step,
            StepRow.rank,
            StepRow.incarnation,
            StepRow.step_seconds,
            StepRow.compute_seconds,
            StepRow.wait_seconds,
            StepRow.pp_stage,
        )
        .where(StepRow.run_id == run_id, StepRow.step > reduced_upto - lookback, StepRow.step <= reduced_upto)
        .order_by(StepRow.incarnation)  # the newest incarnation is written last and wins
    ).all()
    if not rows:
        return None
    steps = sorted({r[0] for r in rows})
    rank_ids = sorted({r[1] for r in rows})
    si = {x: i for i, x in enumerate(steps)}
    ri = {x: i for i, x in enumerate(rank_ids)}
    mats = [np.full((len(steps), len(rank_ids)), np.nan) for _ in range(3)]
    stage = np.full(len(rank_ids), -1, dtype=np.int64)
    for step, rank, _inc, total, comp, wait, pp in rows:
        i, j = si[step], ri[rank]
        mats[0][i, j] = total
        mats[1][i, j] = np.nan if comp is None else comp
        mats[2][i, j] = np.nan if wait is None else wait
        if pp is not None:
            stage[j] = pp
    return RankSteps(
        steps=np.array(steps, dtype=np.int64),
        ranks=np.array(rank_ids, dtype=np.int64),
        step_seconds=mats[0],
        compute_seconds=mats[1],
        wait_seconds=mats[2],
        pp_stage=stage,
    )


def build_series(session: Session, run: Run, *, now: float, config: PipelineConfig = PipelineConfig()) -> Any:
    """RunSeries (the detectors' input) from the summary tables, over the recent lookback."""
    from trainvitals.service.detectors.series import (
        CheckpointEvent,
        GroupGradNorms,
        RunEvent,
        RunSeries,
        RunSteps,
        TensorSeries,
    )

    rid = run.run_id
    latest = session.scalar(select(func.max(StepSummary.step)).where(StepSummary.run_id == rid))
    lo = -1 if latest is None else latest - config.detector_lookback_steps
    s = StepSummary
    rows = session.execute(
        select(
            s.step, s.loss, s.grad_norm, s.grad_nonfinite, s.step_seconds_max, s.ts, s.tokens, s.flops, s.loss_nonfinite
        )
        .where(s.run_id == rid, s.step > lo)
        .order_by(s.step)
    ).all()
    cols = list(zip(*rows, strict=True)) if rows else [[] for _ in range(9)]

    def arr(values: Any, dtype: Any = np.float64) -> np.ndarray:
        return np.array([np.nan if v is None else v for v in values], dtype=dtype)

    steps = RunSteps(
        steps=np.array(cols[0], dtype=np.int64),
        loss=arr(cols[1]),
        grad_norm=arr(cols[2]),
        grad_nonfinite=np.array(cols[3], dtype=np.int64),
        step_seconds=arr(cols[4]),
        ts=arr(cols[5]),
        tokens=arr(cols[6]),
        flops=arr(cols[7]),
    )

    g = GradSummary
    grad_rows = session.execute(
        select(g.step, g.group_name, g.norm).where(g.run_id == rid, g.step > lo, g.group_name != GLOBAL_GROUP)
    ).all()
    groups = None
    if grad_rows:
        names = sorted({r[1] for r in grad_rows})
        gsteps = sorted({r[0] for r in grad_rows})
        gi = {n: i for i, n in enumerate(names)}
        si = {x: i for i, x in enumerate(gsteps)}
        norms = np.full((len(gsteps), len(names)), np.nan)
        for st, name, norm in grad_rows:
            norms[si[st], gi[name]] = norm
        groups = GroupGradNorms(steps=np.array(gsteps, dtype=np.int64), groups=names, norms=norms)

    t = TensorSummary
    tensor_rows = session.execute(
        select(
            t.tensor,
            t.role,
            t.format,
            t.shadow,
            t.step,
            t.amax,
            t.headroom_bits,
            t.lag_bits,
            t.sat_frac,
            t.underflow_frac,
            t.nonfinite,
        )
        .where(t.run_id == rid, t.step > lo)
        .order_by(t.tensor, t.role, t.step)
    ).all()
    tensors: list[Any] = []
    by_tensor: dict[tuple[str, str], list[Any]] = {}
    for r in tensor_rows:
        by_tensor.setdefault((r[0], r[1]), []).append(r)
    for (name, role), rs in by_tensor.items():
        c = list(zip(*rs, strict=True))
        tensors.append(
            TensorSeries(
                tensor=name,
                role=role,
                format=rs[0][2],
                shadow=bool(rs[0][3]),
                steps=np.array(c[4], dtype=np.int64),
                amax=arr(c[5]),
                headroom_bits=arr(c[6]),
                lag_bits=arr(c[7]),
                sat_frac=arr(c[8]),
                underflow_frac=arr(c[9]),
                nonfinite=arr(c[10]),
            )
        )

    ranks = _rank_steps(session, rid, reduced_upto=latest, lookback=config.straggler_lookback_steps)

    checkpoints = [
        CheckpointEvent(
            generation=c.generation,
            step=c.step,
            status=c.status,
            ts=c.ts,
            stall_seconds=c.stall_seconds,
            persist_seconds=c.persist_seconds,
        )
        for c in session.scalars(select(CheckpointRow).where(CheckpointRow.run_id == rid).order_by(CheckpointRow.ts))
    ]
    events = [
        RunEvent(event=e.event, ts=e.ts, step=e.step, detail=e.detail, rank=e.rank)
        for e in session.scalars(select(EventRow).where(EventRow.run_id == rid).order_by(EventRow.ts))
    ]
    reg = run.registration or {}
    history_len = (reg.get("fp8") or {}).get("history_len")
    for ts_ in tensors:
        ts_.history_len = history_len
    return RunSeries(
        run=rid,
        steps=steps,
        groups=groups,
        tensors=tensors,
        ranks=ranks,
        checkpoints=checkpoints,
        events=events,
        expected_mfu=advice.expected_mfu(reg),
        peak_flops_total=peak_flops_total(reg),
        checkpoint_interval_seconds=(reg.get("checkpoint") or {}).get("interval_seconds"),
        now=now,
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
    session: Session, run: Run, *, now: float | None = None, config: PipelineConfig = PipelineConfig()
) -> int:
    """Reduce, detect, store findings. Returns the number of steps reduced."""
    now = time.time() if now is None else now
    reduced = reduce_run(session, run, now=now, config=config)
    from trainvitals.service.detectors.run_all import DetectorConfig, detect
    from trainvitals.service.detectors.suppression import SuppressionConfig

    series = build_series(session, run, now=now, config=config)
    detector_config = DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
    store_findings(session, run.run_id, detect(series, config=detector_config), now=now)
    return reduced
