"""What /metrics shows of one live run, read from the summary tables (bounded work per scrape:
one step summary, one step of tensor summaries, the top-k of one rank window, open findings)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from trainvitals.service.store.models import (
    CheckpointRow,
    FindingRow,
    GradSummary,
    RankWindow,
    Run,
    StepRow,
    StepSummary,
    TensorSummary,
)
from trainvitals.service.store.queries import GLOBAL_GROUP


def layer_of(tensor: str) -> str:
    """'layers.3.mlp.fc' -> 'layers.3': the label for per-layer aggregates (bounded by depth)."""
    parts = tensor.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0]


@dataclass(kw_only=True, slots=True)
class RunSnapshot:
    run_id: str
    project: str
    status: str
    world_size: int
    latest_step: int | None = None
    seconds_since_last_step: float | None = None
    summary: StepSummary | None = None
    mfu_window: float | None = None
    expected_mfu: float | None = None
    grad_groups: dict[str, float] = field(default_factory=dict)
    layer_min_headroom: dict[tuple[str, str], float] = field(default_factory=dict)
    worst_tensors: list[tuple[str, str, float]] = field(default_factory=list)
    saturated_tensors: int = 0
    fp8_step: int | None = None
    slowest_ranks: list[tuple[int, float, float]] = field(default_factory=list)
    """(rank, mean compute seconds -- step seconds when not measured --, ratio to its cohort's
    median) in the newest rank window."""
    findings: list[FindingRow] = field(default_factory=list)
    findings_by_kind: dict[tuple[str, str], int] = field(default_factory=dict)
    checkpoint_last_persisted_step: int | None = None
    checkpoint_last_persisted_ts: float | None = None
    checkpoint_status_counts: dict[str, int] = field(default_factory=dict)
    checkpoint_advice: Any = None
    """CadenceAdvice for the run's observed saves/failures, when there is enough to advise."""


def run_snapshot(
    session: Session,
    *,
    run: Run,
    now: float,
    top_k: int,
    max_groups: int,
    mfu_window_steps: int = 20,
    expected_mfu: float | None = None,
) -> RunSnapshot:
    rid = run.run_id
    snap = RunSnapshot(
        run_id=rid,
        project=run.project,
        status=run.status,
        world_size=run.world_size,
        expected_mfu=expected_mfu,
    )
    # Raw steps grow by world_size rows per step: max(ts) over the whole run is a scan of millions
    # of rows at 16,384 ranks. The newest step comes off the (run_id, step, rank) index, and the
    # newest timestamp is taken among that step's rows (at most world_size of them): ranks finish
    # a step within one step time of each other, so this is the age of the newest work.
    snap.latest_step = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == rid))
    if snap.latest_step is not None:
        last_ts = session.scalar(
            select(func.max(StepRow.ts)).where(StepRow.run_id == rid, StepRow.step == snap.latest_step)
        )
        if last_ts is not None:
            snap.seconds_since_last_step = max(0.0, now - last_ts)

    recent = list(
        session.scalars(
            select(StepSummary)
            .where(StepSummary.run_id == rid)
            .order_by(StepSummary.step.desc())
            .limit(mfu_window_steps)
        )
    )
    if recent:
        snap.summary = recent[0]
        with_mfu = [s for s in recent if s.flops and s.mfu]
        if with_mfu:
            # Window MFU: total FLOPs over (total time x peak), not a mean of per-step ratios.
            peak = with_mfu[0].flops / (with_mfu[0].mfu * with_mfu[0].step_seconds_max)
            total_time = sum(s.step_seconds_max for s in with_mfu)
            snap.mfu_window = sum(s.flops for s in with_mfu) / (total_time * peak)
        step = snap.summary.step
        groups = session.execute(
            select(GradSummary.group_name, GradSummary.norm)
            .where(
                GradSummary.run_id == rid, GradSummary.step == step, GradSummary.group_name != GLOBAL_GROUP
            )
            .limit(max_groups)
        ).all()
        snap.grad_groups = {g: n for g, n in groups}

    fp8_step = session.scalar(select(func.max(TensorSummary.step)).where(TensorSummary.run_id == rid))
    if fp8_step is not None:
        snap.fp8_step = fp8_step
        rows = session.execute(
            select(TensorSummary.tensor, TensorSummary.role, TensorSummary.headroom_bits).where(
                TensorSummary.run_id == rid,
                TensorSummary.step == fp8_step,
                TensorSummary.headroom_bits.is_not(None),
            )
        ).all()
        for tensor, role, hr in rows:
            key = (layer_of(tensor), role)
            snap.layer_min_headroom[key] = min(hr, snap.layer_min_headroom.get(key, np.inf))
            if hr < 0:
                snap.saturated_tensors += 1
        snap.worst_tensors = sorted(((t, r, h) for t, r, h in rows), key=lambda x: x[2])[:top_k]

    newest_window = session.scalar(
        select(func.max(RankWindow.window_start)).where(RankWindow.run_id == rid, RankWindow.steps > 1)
    )
    if newest_window is not None:
        win = session.execute(
            # Compute time (step minus collective wait) when measured: in synchronous training every
            # rank's step lasts as long as the slowest one's, so step time cannot single it out.
            select(
                RankWindow.rank,
                func.coalesce(RankWindow.compute_seconds_mean, RankWindow.step_seconds_mean),
                RankWindow.pp_stage,
            ).where(
                RankWindow.run_id == rid, RankWindow.window_start == newest_window
            )
        ).all()
        cohort: dict[int | None, list[float]] = {}
        for _rank, mean, stage in win:
            cohort.setdefault(stage, []).append(mean)
        medians = {k: float(np.median(v)) for k, v in cohort.items()}
        ranked = sorted(
            ((r, m, m / medians[s] if medians[s] > 0 else 1.0) for r, m, s in win), key=lambda x: -x[2]
        )
        snap.slowest_ranks = ranked[:top_k]

    snap.findings = list(
        session.scalars(select(FindingRow).where(FindingRow.run_id == rid, FindingRow.active.is_(True)))
    )
    snap.findings_by_kind = {
        (k, s): n
        for k, s, n in session.execute(
            select(FindingRow.kind, FindingRow.severity, func.count())
            .where(FindingRow.run_id == rid)
            .group_by(FindingRow.kind, FindingRow.severity)
        )
    }
    # One ordered probe per status rather than `status IN (...) ORDER BY step DESC`: with the
    # (run_id, status, step) index each probe reads one index entry, whereas the IN form has to
    # sort every persisted row of every rank (world_size rows per generation).
    newest = [
        row
        for status in ("persisted", "verified")
        if (
            row := session.execute(
                select(CheckpointRow.step, CheckpointRow.ts)
                .where(CheckpointRow.run_id == rid, CheckpointRow.status == status)
                .order_by(CheckpointRow.step.desc())
                .limit(1)
            ).first()
        )
        is not None
    ]
    if newest:
        snap.checkpoint_last_persisted_step, snap.checkpoint_last_persisted_ts = max(newest, key=lambda r: r[0])
    snap.checkpoint_status_counts = dict(
        session.execute(
            select(CheckpointRow.status, func.count())
            .where(CheckpointRow.run_id == rid)
            .group_by(CheckpointRow.status)
        ).all()
    )
    return snap
