"""The queries behind the read API, the CLI, the post-mortem tools and the demo, and the live-run
list that the analysis worker and /metrics share (and the liveness ping): keyword-only functions
over a Session. One write lives here too, `delete_run`.

The rest of the collector's SQL sits beside this module, by what it serves: ingest writes
(batches.py), the reduction (summaries.py), the detectors' input (detector_reads.py), findings
(findings.py), /metrics (snapshot.py), API tokens (tokens.py), the analysis lease (lease.py).
Reads of raw per-rank rows apply the newest-incarnation rule (incarnations.py)."""

from __future__ import annotations

import math
import time
from collections.abc import Sized
from dataclasses import dataclass
from typing import Any, NamedTuple

from sqlalchemy import case, delete, func, or_, select, text
from sqlalchemy.orm import Session

from trainvitals.service.store import batches, run_keys
from trainvitals.service.store.incarnations import newest_incarnation_only
from trainvitals.service.store.models import (
    CheckpointRow,
    DeliveredBatch,
    DetectorBlock,
    EventRow,
    FindingRow,
    GradStatRow,
    GradSummary,
    IngestCount,
    RankWindow,
    ReductionState,
    RefusedIncarnation,
    Run,
    StepRow,
    StepSummary,
    TensorStatRow,
    TensorSummary,
)
from trainvitals.service.store.snapshot import newest_step_end, window_mfu
from trainvitals.wire.conventions import DEFAULT_DETECTOR_WARMUP_STEPS, GLOBAL_GROUP


def list_runs(session: Session, *, project: str | None = None) -> list[Run]:
    query = select(Run).order_by(Run.created_at)
    if project is not None:
        query = query.where(Run.project == project)
    return list(session.scalars(query))


def live_runs(
    session: Session, *, now: float, finished_grace_seconds: float, idle_seconds: float
) -> list[Run]:
    """Runs that belong in /metrics: running and seen recently, or finished within the grace."""
    horizon_running = now - idle_seconds
    horizon_finished = now - finished_grace_seconds
    query = select(Run).where(
        ((Run.status == "running") & (Run.last_seen_at >= horizon_running))
        | ((Run.status == "finished") & (Run.last_seen_at >= horizon_finished))
    )
    return list(session.scalars(query))


def global_grad_norm(session: Session, *, run_id: str, step: int) -> float | None:
    """sqrt of the sum over ranks of owned sums of squares (shards once, replicas once; a replayed
    step once, from the newest incarnation)."""
    g = GradStatRow
    total = session.scalar(
        select(func.sum(g.owned_sq)).where(
            g.run_id == run_id,
            g.step == step,
            g.group_name == GLOBAL_GROUP,
            newest_incarnation_only(g, run_id=run_id, first=step, last=step),
        )
    )
    return None if total is None else math.sqrt(total)


@dataclass(kw_only=True, slots=True)
class RunOverview:
    """What the demo prints and `trainvitals query runs` shows."""

    run_id: str
    project: str
    status: str
    world_size: int
    ranks: int
    """Most ranks that reported one step."""
    steps: int
    step_records: int
    """Records stored, by kind (from the ingest counters, this and the other *_records/events)."""
    first_step: int | None
    last_step: int | None
    step_seconds_p50: float | None
    """Median over steps of the cross-rank median step time."""
    step_seconds_min_rank_mean: float | None
    step_seconds_max_rank_mean: float | None
    """Per-rank means over the newest 20 rank windows (1,000 steps by default), as is slowest_rank."""
    slowest_rank: int | None
    tensor_records: int
    grad_records: int
    checkpoint_records: int
    events: int
    detector_warmup_steps: int
    """Steps from the first step during which the baseline detectors stay quiet: the run's
    registered `detector_warmup_steps`, else the collector's."""
    detection_starts_at_step: int | None
    """first_step + detector_warmup_steps (None before the first step)."""
    warmup_steps_remaining: int | None
    """Steps still to run until detection starts (0: it has; None before the first step)."""
    detection: str
    """One line: when detection starts, or since when it runs."""
    mfu: str
    """One line: the measured MFU of the newest reduced steps, or why there is none (`_mfu_line`)."""


def _detection(
    *, status: str, first: int | None, last: int | None, warmup: int
) -> tuple[int | None, int | None, str]:
    """(detection_starts_at_step, warmup_steps_remaining, detection): a run shorter than the
    warm-up says so, rather than looking healthy because nothing was judged yet."""
    always = "non-finite values, failed checkpoints and stalls"
    if first is None or last is None:
        return None, None, (
            f"no steps yet: detection starts {warmup} steps after the first step (warm-up); {always} "
            "are reported from the start"
        )
    starts = first + warmup
    remaining = max(starts - last, 0)
    if remaining == 0:
        return starts, 0, f"detecting since step {starts} (warm-up: {warmup} steps from step {first})"
    if status == "finished":
        return starts, remaining, (
            f"the run ended at step {last}, before detection would have started at step {starts} (warm-up: "
            f"{warmup} steps from step {first}): only {always} were checked; to judge short runs, register "
            "a smaller detector_warmup_steps"
        )
    return starts, remaining, (
        f"detection starts at step {starts}, {remaining} steps from now (warm-up: {warmup} steps from step "
        f"{first}); until then only {always} are reported"
    )


def run_overview(
    session: Session, *, run_id: str, warmup_steps: int = DEFAULT_DETECTOR_WARMUP_STEPS
) -> RunOverview | None:
    """Counts from the ingest counters, steps and ranks from the summaries plus the unreduced tail,
    per-rank means from the newest rank windows: index probes and small reads, never a scan of the
    raw tables (billions of rows at 16,384 ranks x 100k steps).

    warmup_steps: the collector's detector warm-up (Settings.detector_warmup_steps); a run that
    registered its own is told with that one."""
    run = session.get(Run, run_id)
    if run is None:
        return None
    kinds = [IngestCount.step_records, IngestCount.tensor_records, IngestCount.grad_records,
             IngestCount.checkpoint_records, IngestCount.event_records]  # fmt: skip
    counts = session.execute(
        select(*(func.coalesce(func.sum(k), 0) for k in kinds)).where(
            IngestCount.run_id == run_id, IngestCount.outcome == "stored"
        )
    ).one()
    first_step = session.scalar(select(func.min(StepRow.step)).where(StepRow.run_id == run_id))
    last_step = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == run_id))
    state = session.get(ReductionState, run_id)
    reduced_upto = state.reduced_upto if state is not None else -1
    reduced = session.execute(
        select(func.count(), func.max(StepSummary.ranks)).where(
            StepSummary.run_id == run_id, StepSummary.step <= reduced_upto
        )
    ).one()
    tail = session.execute(
        select(func.count(func.distinct(StepRow.step)), func.count(func.distinct(StepRow.rank))).where(
            StepRow.run_id == run_id, StepRow.step > reduced_upto
        )
    ).one()
    # Median step time from the per-step summaries (one value per step, not one per rank and step);
    # only a run nobody has reduced yet falls back to the raw rows of its unreduced tail.
    times = sorted(session.scalars(select(StepSummary.step_seconds_p50).where(StepSummary.run_id == run_id)).all())
    if not times:
        times = sorted(
            session.scalars(
                select(StepRow.step_seconds).where(
                    StepRow.run_id == run_id,
                    StepRow.step > reduced_upto,
                    newest_incarnation_only(StepRow, run_id=run_id, first=reduced_upto + 1),
                )
            )
        )
    per_rank = _recent_rank_means(session, run_id, reduced_upto)
    slowest = max(per_rank, key=lambda r: r[1]) if per_rank else None
    own = run.registration.get("detector_warmup_steps")
    warmup = warmup_steps if own is None else int(own)
    starts, remaining, detection = _detection(status=run.status, first=first_step, last=last_step, warmup=warmup)
    return RunOverview(
        run_id=run_keys.run_id_of(run.run_id),
        project=run.project,
        status=run.status,
        world_size=run.world_size,
        ranks=max(reduced[1] or 0, tail[1]),
        steps=reduced[0] + tail[0],
        step_records=int(counts[0]),
        first_step=first_step,
        last_step=last_step,
        step_seconds_p50=times[len(times) // 2] if times else None,
        step_seconds_min_rank_mean=min(r[1] for r in per_rank) if per_rank else None,
        step_seconds_max_rank_mean=max(r[1] for r in per_rank) if per_rank else None,
        slowest_rank=slowest[0] if slowest else None,
        tensor_records=int(counts[1]),
        grad_records=int(counts[2]),
        checkpoint_records=int(counts[3]),
        events=int(counts[4]),
        detector_warmup_steps=warmup,
        detection_starts_at_step=starts,
        warmup_steps_remaining=remaining,
        detection=detection,
        mfu=_mfu_line(session, run),
    )


# The model fields the agent needs for FLOPs per token (6N + 12 L H Q T, docs/agent.md).
_FLOPS_FIELDS = ("non_embedding_params", "layers", "hidden", "seq_len")


def _mfu_line(session: Session, run: Run, window: int = 20) -> str:
    """The MFU over the newest `window` reduced steps, or the first thing missing for one: a
    device peak (declared, or from the GPU table), then FLOPs per step (the agent's, from the
    model's dims and the step's tokens, or the job's own step(flops=))."""
    recent = list(
        session.scalars(
            select(StepSummary).where(StepSummary.run_id == run.run_id).order_by(StepSummary.step.desc()).limit(window)
        )
    )
    if not recent:
        return "no MFU yet: no reduced step"
    if (mfu := window_mfu(recent)) is not None:  # the same window MFU /metrics exports
        measured = sum(1 for r in recent if r.flops and r.mfu and r.peak_flops_total)
        return f"MFU {mfu:.1%} over the newest {measured} reduced steps"
    reg = run.registration or {}
    hw = reg.get("hardware") or {}
    if not any(r.peak_flops_total for r in recent):
        gpu = hw.get("gpu_type")
        if gpu == "cpu":
            return "no MFU: the run is on CPU; declare hardware.peak_flops (dense FLOP/s per device) to get one"
        if gpu:
            return f"no MFU: GPU {gpu!r} is not in the hardware table; declare hardware.peak_flops (dense FLOP/s)"
        return "no MFU: the device's peak is unknown; declare hardware.gpu_type or hardware.peak_flops"
    if not any(r.tokens for r in recent):
        return "no MFU: the steps carry neither FLOPs nor tokens; pass step(tokens=...) or step(flops=...)"
    missing = [f"model.{f}" for f in _FLOPS_FIELDS if not (reg.get("model") or {}).get(f)]
    lacks = f"the registration lacks {', '.join(missing)}" if missing else "the agent did not compute them"
    return f"no MFU: no FLOPs per step ({lacks}); declare them in registration={{'model': ...}} or pass step(flops=...)"


_OVERVIEW_WINDOWS = 20


def _recent_rank_means(session: Session, run_id: str, reduced_upto: int) -> list[tuple[int, float]]:
    """(rank, mean step seconds) over the newest rank windows (1,000 steps at the default window),
    or over the raw unreduced tail when nothing is reduced yet."""
    newest = session.scalar(select(func.max(RankWindow.window_start)).where(RankWindow.run_id == run_id))
    if newest is None:
        return [
            (int(r), float(m))
            for r, m in session.execute(
                select(StepRow.rank, func.avg(StepRow.step_seconds))
                .where(
                    StepRow.run_id == run_id,
                    StepRow.step > reduced_upto,
                    newest_incarnation_only(StepRow, run_id=run_id, first=reduced_upto + 1),
                )
                .group_by(StepRow.rank)
            )
        ]
    # The newest windows' starts, read along one rank's windows (index run_id, rank, window_start):
    # a DISTINCT over all ranks' windows would read every window row of the run.
    w = RankWindow
    a_rank = session.scalar(select(w.rank).where(w.run_id == run_id, w.window_start == newest).limit(1))
    starts = session.scalars(
        select(w.window_start)
        .where(w.run_id == run_id, w.rank == a_rank)
        .order_by(w.window_start.desc())
        .limit(_OVERVIEW_WINDOWS)
    ).all()
    return [
        (int(r), float(total / n))
        for r, total, n in session.execute(
            select(w.rank, func.sum(w.step_seconds_mean * w.steps), func.sum(w.steps))
            .where(w.run_id == run_id, w.window_start >= min(starts))
            .group_by(w.rank)
        )
        if n
    ]


def step_keys(session: Session, *, run_id: str) -> set[tuple[int, int, int]]:
    """(rank, incarnation, step) of every stored step record; used by exactly-once checks."""
    rows = session.execute(
        select(StepRow.rank, StepRow.incarnation, StepRow.step).where(StepRow.run_id == run_id)
    ).all()
    return {(r[0], r[1], r[2]) for r in rows}


def count_step_rows(session: Session, *, run_id: str) -> int:
    return int(session.scalar(select(func.count()).select_from(StepRow).where(StepRow.run_id == run_id)) or 0)


_RUN_TABLES: tuple[type[Any], ...] = (
    StepRow,
    TensorStatRow,
    GradStatRow,
    CheckpointRow,
    EventRow,
    DeliveredBatch,
    StepSummary,
    TensorSummary,
    GradSummary,
    RankWindow,
    FindingRow,
    ReductionState,
    RefusedIncarnation,
    DetectorBlock,
)
"""Every table with rows of a run, but `runs` itself."""

DELETE_CHUNK_ROWS = 10_000
"""Rows per transaction of delete_run's chunks: on SQLite each holds the one write lock, which
ingest of every run waits for (10,000 rows: tens of ms)."""

DELETE_PAUSE_S = 0.1
"""On SQLite, the pause between two chunks of delete_run, the lock free."""


def delete_run(session: Session, *, run_id: str) -> bool:
    """Delete a run and every record of it; returns False when there was no such run.

    Its records go first in transactions of DELETE_CHUNK_ROWS rows each, committed one by one: as
    one transaction, a big run's delete held SQLite's write lock for minutes, and every run's
    ingest answered 503 meanwhile. Then, in one transaction, whatever came in since (ingest or the
    analysis may still write) and the run's row. That row is locked first: an analysis write of
    the run (store/lease.py fence) either finishes before it or finds the run gone, so no summary
    outlives it."""
    if session.get(Run, run_id) is None:
        return False
    session.commit()
    # SQLite's busy handler retries after sleeps of up to 100 ms: a writer waiting for the lock
    # would miss a shorter gap between two chunks, and wait out the whole delete.
    pause = DELETE_PAUSE_S if session.get_bind().dialect.name == "sqlite" else 0.0
    for model in _RUN_TABLES:
        while _delete_chunk(session, model.__tablename__, run_id) >= DELETE_CHUNK_ROWS:
            time.sleep(pause)
    if session.get(Run, run_id, with_for_update=True) is None:
        session.commit()
        return False  # a concurrent delete of the run finished first
    for model in _RUN_TABLES:
        session.execute(delete(model).where(model.run_id == run_id))
    batches.retire_counts(session, run_id=run_id)
    session.execute(delete(Run).where(Run.run_id == run_id))
    session.commit()
    return True


def _delete_chunk(session: Session, table: str, run_id: str) -> int:
    """Delete up to DELETE_CHUNK_ROWS rows of the run from `table` (committed); returns how many.
    By the row's physical address, found through the table's index on run_id: every table here
    has one. On PostgreSQL a partitioned table's ctids repeat across partitions, hence the
    run_id test on the DELETE too (it may then take a few more rows of the run)."""
    if session.get_bind().dialect.name == "postgresql":
        sql = (
            f"DELETE FROM {table} WHERE run_id = :run AND ctid = ANY(ARRAY("
            f"SELECT ctid FROM {table} WHERE run_id = :run LIMIT :n))"
        )
    else:
        sql = f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table} WHERE run_id = :run LIMIT :n)"
    deleted = session.execute(text(sql), {"run": run_id, "n": DELETE_CHUNK_ROWS}).rowcount  # type: ignore[attr-defined]
    session.commit()
    return int(deleted)


def rank_step_seconds(session: Session, *, run_id: str) -> list[tuple[int, float, float, float]]:
    """Per rank: (rank, mean, p50, p99) step seconds over the whole run (a replayed step once)."""
    rows = session.execute(
        select(StepRow.rank, StepRow.step_seconds)
        .where(StepRow.run_id == run_id, newest_incarnation_only(StepRow, run_id=run_id))
        .order_by(StepRow.rank)
    ).all()
    by_rank: dict[int, list[float]] = {}
    for rank, seconds in rows:
        by_rank.setdefault(rank, []).append(seconds)
    out = []
    for rank, values in sorted(by_rank.items()):
        values.sort()
        out.append(
            (
                rank,
                sum(values) / len(values),
                values[len(values) // 2],
                values[min(len(values) - 1, int(0.99 * len(values)))],
            )
        )
    return out


def get_run(session: Session, *, run_id: str) -> Run | None:
    return session.get(Run, run_id)


# --------------------------------------------------------------------------- post-mortem queries


class TooManyRowsError(ValueError):
    """A read that would hold more rows than one answer may: said, not cut short (a cut-off
    answer reads as missing data: missing ranks look like stragglers, missing roles like none)."""


def _at_most(rows: Sized, limit: int, start: int | None, end: int | None, what: str, narrow: str = "") -> None:
    if len(rows) > limit:
        bounds = ("" if b is None else str(b) for b in (start, end))
        asked = "every step" if start is None and end is None else "steps " + "..".join(bounds)
        raise TooManyRowsError(
            f"{asked} hold more than {limit:,} {what}, the most one answer holds: ask for a shorter step range"
            + (f" {narrow}" if narrow else "")
        )


def tensor_timeline(
    session: Session,
    *,
    run_id: str,
    tensor: str,
    role: str | None = None,
    start: int | None = None,
    end: int | None = None,
    limit: int = 100_000,
) -> list[dict[str, Any]]:
    """A tensor's reduced FP8 statistics per step (amax max over ranks, headroom min)."""
    t = TensorSummary
    q = select(t).where(t.run_id == run_id, t.tensor == tensor)
    if role is not None:
        q = q.where(t.role == role)
    q = _step_range(q, t.step, start, end).order_by(t.role, t.step).limit(limit + 1)
    rows = [_row_dict(r, exclude=("run_id",)) for r in session.scalars(q)]
    _at_most(rows, limit, start, end, f"rows of tensor {tensor!r}", "or one role")
    return rows


def worst_tensors(
    session: Session, *, run_id: str, start: int | None = None, end: int | None = None, k: int = 10
) -> list[dict[str, Any]]:
    """Tensors with the least headroom in a step range, with how often they clipped (H < 0)."""
    t = TensorSummary
    q = select(
        t.tensor,
        t.role,
        func.min(t.headroom_bits).label("min_headroom_bits"),
        func.max(t.amax).label("max_amax"),
        func.sum(case((t.headroom_bits < 0, 1), else_=0)).label("clipped_steps"),
        func.max(t.sat_frac).label("max_sat_frac"),
        func.min(t.step).label("first_step"),
        func.max(t.step).label("last_step"),
    ).where(t.run_id == run_id, t.headroom_bits.is_not(None))
    q = (
        _step_range(q, t.step, start, end)
        .group_by(t.tensor, t.role)
        .order_by(func.min(t.headroom_bits))
        .limit(k)
    )
    return [dict(r._mapping) for r in session.execute(q)]


def step_time_matrix(
    session: Session, *, run_id: str, start: int, end: int, max_cells: int = 2_000_000
) -> dict[str, Any]:
    """Per-rank step seconds for a step range: {ranks, steps, seconds[step][rank] (None = missing)}.
    The newest incarnation wins where a restart repeated steps."""
    rows = session.execute(
        select(StepRow.step, StepRow.rank, StepRow.step_seconds)
        .where(
            StepRow.run_id == run_id,
            StepRow.step >= start,
            StepRow.step <= end,
            newest_incarnation_only(StepRow, run_id=run_id, first=start, last=end),
        )
        .order_by(StepRow.step, StepRow.rank)
        .limit(max_cells + 1)
    ).all()
    _at_most(rows, max_cells, start, end, "rank step times")
    cells: dict[tuple[int, int], float] = {(step, rank): seconds for step, rank, seconds in rows}
    ranks = sorted({r for _, r in cells})
    steps = sorted({s for s, _ in cells})
    return {
        "run": run_keys.run_id_of(run_id),
        "ranks": ranks,
        "steps": steps,
        "seconds": [[cells.get((s, r)) for r in ranks] for s in steps],
    }


STEP_HISTORY_COLUMNS = (
    "step", "ts", "ranks", "loss", "loss_nonfinite", "grad_norm", "grad_nonfinite", "skipped_ranks",
    "tokens", "step_seconds_p50", "step_seconds_max", "mfu",
)  # fmt: skip
"""What step_history answers per step, in order (StepSummary columns)."""


def step_history(
    session: Session, *, run_id: str, start: int | None = None, end: int | None = None, limit: int = 1_000_000
) -> list[dict[str, Any]]:
    """Per-step loss, gradient norm, tokens, step time and MFU from the step summaries (reduced
    over ranks; steps not yet reduced are not here). step_seconds_max is the step's wall time
    (the slowest rank), the one MFU divides by."""
    s = StepSummary
    q = select(*(getattr(s, c) for c in STEP_HISTORY_COLUMNS)).where(s.run_id == run_id)
    q = _step_range(q, s.step, start, end).order_by(s.step).limit(limit + 1)
    rows = [dict(r._mapping) for r in session.execute(q)]
    _at_most(rows, limit, start, end, "steps")
    return rows


def reduced_step_range(session: Session, *, run_id: str) -> tuple[int, int] | None:
    """The first and last reduced step of a run (None: nothing reduced yet); read from the primary key."""
    first, last = session.execute(
        select(func.min(StepSummary.step), func.max(StepSummary.step)).where(StepSummary.run_id == run_id)
    ).one()
    return None if first is None else (first, last)


def stored_step_range(session: Session, *, run_id: str) -> tuple[int, int] | None:
    """The first and last step of a run with a rank's step time stored (None: none yet)."""
    first, last = session.execute(
        select(func.min(StepRow.step), func.max(StepRow.step)).where(StepRow.run_id == run_id)
    ).one()
    return None if first is None else (first, last)


def tensor_step_range(
    session: Session, *, run_id: str, tensor: str | None = None, role: str | None = None
) -> tuple[int, int] | None:
    """The first and last step with reduced FP8 statistics of a run, or of one tensor (and role)
    of it (None: none)."""
    t = TensorSummary
    q = select(func.min(t.step), func.max(t.step)).where(t.run_id == run_id)
    if tensor is not None:
        q = q.where(t.tensor == tensor)
    if role is not None:
        q = q.where(t.role == role)
    first, last = session.execute(q).one()
    return None if first is None else (first, last)


def tensor_roles(session: Session, *, run_id: str, tensor: str) -> list[str]:
    """The roles (input, weight, grad_output) a tensor of the run has FP8 statistics for."""
    t = TensorSummary
    q = select(t.role).where(t.run_id == run_id, t.tensor == tensor).distinct().order_by(t.role)
    return list(session.scalars(q))


def findings(session: Session, *, run_id: str, active_only: bool = False) -> list[dict[str, Any]]:
    q = select(FindingRow).where(FindingRow.run_id == run_id)
    if active_only:
        q = q.where(FindingRow.active.is_(True))
    order = case((FindingRow.severity == "page", 0), (FindingRow.severity == "ticket", 1), else_=2)
    return [
        _row_dict(f, exclude=("id", "run_id"))
        for f in session.scalars(q.order_by(order, FindingRow.onset_step))
    ]


def checkpoint_generations(session: Session, *, run_id: str) -> list[dict[str, Any]]:
    """One entry per generation (and incarnation), across ranks: failed if any rank failed;
    deleted if any rank's files of it are gone since its save (a generation missing a rank's part
    cannot be restored); persisted when every rank that started it persisted; verified when
    persisted with a path from every such rank and a checksum of each path from some rank (a
    directory every rank names is hashed by rank 0 alone: agent/_checkpoints.py), or with an
    explicit 'verified' record.

    Aggregated in SQL per (generation, incarnation, status): the cost is generations x statuses,
    not ranks x generations (16,384 ranks each record every save)."""
    c = CheckpointRow
    rows = session.execute(
        # bytes summed as floats: SQLite's integer sum raises on overflow (ranks' sizes near INT64_MAX).
        select(c.generation, c.incarnation, c.status, func.count(func.distinct(c.rank)), func.min(c.step),
               func.sum(c.bytes * 1.0), func.max(c.stall_seconds), func.max(c.persist_seconds),
               func.count(func.distinct(c.path)), func.count(func.distinct(case((c.checksum.is_not(None), c.path)))),
               func.count() - func.count(c.path), func.max(c.ts), func.min(c.path), func.max(c.error))
        .where(c.run_id == run_id)
        .group_by(c.generation, c.incarnation, c.status)
    ).all()
    gens: dict[tuple[int, int], dict[str, Any]] = {}
    for gen, inc, status, ranks, step, size, stall, persist, paths, hashed, pathless, ts, path, error in rows:
        g = gens.setdefault((gen, inc), {"generation": gen, "step": step, "incarnation": inc, "counts": {},
                                         "unhashed": 0, "bytes": None, "stall_seconds": None,
                                         "persist_seconds": None, "path": None, "ts": None, "errors": []})
        g["counts"][status] = ranks
        g["step"] = min(g["step"], step)
        if status != "deleted":  # the save's time and path, not the deletion's
            g["ts"] = ts if g["ts"] is None else max(g["ts"], ts)
            g["path"] = path if g["path"] is None else min(g["path"], path or g["path"])
        if stall is not None:
            g["stall_seconds"] = max(g["stall_seconds"] or 0.0, stall)
        if status in ("persisted", "verified"):
            g["bytes"] = (g["bytes"] or 0) + int(size or 0) or None
            g["persist_seconds"] = persist
            g["unhashed"] += paths - hashed + pathless
        if error:
            g["errors"].append(error)
    out = []
    for g in sorted(gens.values(), key=lambda g: (g["step"], g["incarnation"])):
        n = g.pop("counts")
        unhashed = g.pop("unhashed")
        if g["ts"] is None:
            # Only a deletion is stored: nothing restorable is known of it. A restarted rank's
            # ledger (agent/_checkpoint_ledger.py) may name an earlier run's save under this id.
            continue
        done = n.get("persisted", 0) + n.get("verified", 0)
        # Ranks that reported anything for it (an after-the-fact save has no 'started' record).
        involved = max(n.get("started", 0), done + n.get("failed", 0))
        if n.get("failed"):
            status = "failed"
        elif n.get("deleted"):
            status = "deleted"
        elif n.get("verified") or (done >= involved and not unhashed and involved):
            status = "verified"
        elif done >= involved and involved:
            status = "persisted"
        else:
            status = "started"
        out.append({**g, "status": status, "ranks": involved})
    return out


STATE_FINDING_PREFIXES = ("loss_", "grad_", "fp8_")
"""Finding kinds about the model's state (its loss, gradients, FP8 scaling): the default rollback
goes to before the first open one. Not the job's speed (stragglers, MFU), its saves or stalls, nor
the collector's own analysis: they say nothing about which weights are good."""


def rollback_target(session: Session, *, run_id: str, before_step: int | None = None) -> dict[str, Any]:
    """The newest verified (else persisted) generation saved before `before_step`, or, by default,
    before the onset of the earliest open page- or ticket-level finding on the model's state
    (STATE_FINDING_PREFIXES). Closed ones are left out: a spike the run recovered from long ago
    would otherwise pin every later rollback before it."""
    reason = f"before step {before_step}" if before_step is not None else None
    if before_step is None:
        first = session.execute(
            select(FindingRow.onset_step, FindingRow.kind, FindingRow.subject)
            .where(
                FindingRow.run_id == run_id,
                FindingRow.severity.in_(("page", "ticket")),
                FindingRow.active.is_(True),
                or_(*(FindingRow.kind.startswith(p, autoescape=True) for p in STATE_FINDING_PREFIXES)),
            )
            .order_by(FindingRow.onset_step)
            .limit(1)
        ).first()
        if first is not None:
            before_step = first[0]
            subject = first[2] or "the run"
            reason = f"before the onset of the first open finding ({first[1]} on {subject}) at step {first[0]}"
    gens = checkpoint_generations(session, run_id=run_id)
    earlier = [g for g in gens if before_step is None or g["step"] < before_step]
    candidates = [g for g in earlier if g["status"] in ("verified", "persisted")]
    verified = [g for g in candidates if g["status"] == "verified"]
    pick = (verified or candidates)[-1] if candidates else None
    reason = reason or "newest usable generation"
    if pick is None:
        reason += f": none, {_why_no_target(gens, before_step)}"
    elif gone := [g for g in earlier if g["status"] == "deleted" and g["step"] > pick["step"]]:
        why = f": {gone[-1]['errors'][-1]}" if gone[-1]["errors"] else ""
        reason += f"; {len(gone)} newer generation(s) before it deleted since their save (step {gone[-1]['step']}{why})"
    return {
        "run": run_keys.run_id_of(run_id),
        "before_step": before_step,
        "reason": reason,
        "target": pick,
        "verified": pick is not None and pick["status"] == "verified",
        "generations_considered": len(gens),
    }


def _why_no_target(gens: list[dict[str, Any]], before_step: int | None) -> str:
    """Why no generation qualifies, in words a post-mortem reader acts on."""
    if not gens:
        return "no checkpoint save was recorded for this run (agent.checkpoint(...) or agent.save(...) records one)"
    earlier = [g["status"] for g in gens if before_step is None or g["step"] < before_step]
    parts = [f"{earlier.count('failed')} failed"] if "failed" in earlier else []
    if "deleted" in earlier:
        parts.append(f"{earlier.count('deleted')} deleted since their save (the job's retention, or a later save "
                     "to the same path)")  # fmt: skip
    if "started" in earlier:
        parts.append(f"{earlier.count('started')} started and never persisted")
    if len(earlier) < len(gens):
        parts.append(f"{len(gens) - len(earlier)} at or after step {before_step}")
    where = "" if before_step is None else f" before step {before_step}"
    usable = "was persisted and is still on disk" if "deleted" in earlier else "was persisted"
    return f"of {len(gens)} recorded generation(s) none {usable}{where} ({', '.join(parts)})"


def _step_range(q: Any, col: Any, start: int | None, end: int | None) -> Any:
    if start is not None:
        q = q.where(col >= start)
    if end is not None:
        q = q.where(col <= end)
    return q


def _row_dict(row: Any, *, exclude: tuple[str, ...] = ()) -> dict[str, Any]:
    return {c.key: getattr(row, c.key) for c in row.__table__.columns if c.key not in exclude}


def last_step_time(session: Session, *, run_id: str) -> float | None:
    return session.scalar(select(func.max(StepRow.ts)).where(StepRow.run_id == run_id))


def observed_cadence_inputs(
    session: Session, *, run_id: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """A run's checkpoint saves (one per generation: the slowest rank's stall and persist, the
    total size) and failure events, in the shape the cadence advisor takes, and the exposure
    (seconds from the run's registration to its newest step: no scan of raw steps)."""
    saves = [
        {"stall_s": g["stall_seconds"], "persist_s": g["persist_seconds"], "size_bytes": g["bytes"], "status": "ok"}
        for g in checkpoint_generations(session, run_id=run_id)
        if g["status"] in ("persisted", "verified", "deleted") and g["stall_seconds"]  # deleted: saved, then retired
    ]
    failures = [
        {"timestamp": e.ts, "ranks": [e.rank], "domains": e.domains or {}, "cause": e.detail or e.event}
        for e in session.scalars(select(EventRow).where(
            EventRow.run_id == run_id, EventRow.event.in_(("failure", "node_replaced"))).order_by(EventRow.ts))
    ]
    # From registration to the newest step's end, both on the job's clock when it registered its
    # start (started_at): a replayed recording is judged by its own span, not by the day it was
    # replayed (last_seen_at, the collector's clock, made a month-old recording a month of exposure).
    run = session.get(Run, run_id)
    if run is None:
        return saves, failures, 0.0
    end = newest_step_end(session, run_id=run_id)
    return saves, failures, max(0.0, (end if end is not None else run.last_seen_at) - run.created_at)


class IngestCountRow(NamedTuple):
    run_id: str
    outcome: str
    batches: int
    records: int


def ingest_counts(session: Session, *, project: str | None = None) -> list[IngestCountRow]:
    """Ingest outcomes summed over every writer of every collector process, per run key.

    project: only that project's: its runs' and its no-run key's (run_keys.no_run_key: its
    deleted runs' counts, its batches refused for a run it has not registered)."""
    q = select(
        IngestCount.run_id,
        IngestCount.outcome,
        func.sum(IngestCount.batches),
        func.sum(IngestCount.records),
    ).group_by(IngestCount.run_id, IngestCount.outcome)
    if project is not None:
        own = select(Run.run_id).where(Run.project == project)
        q = q.where(or_(IngestCount.run_id.in_(own), IngestCount.run_id == run_keys.no_run_key(project)))
    return [IngestCountRow(r[0], r[1], int(r[2] or 0), int(r[3] or 0)) for r in session.execute(q)]


def ingest_totals(session: Session, *, writer_prefix: str) -> dict[str, tuple[int, int]]:
    """Batches and records by outcome (stored | duplicate | rejected) written by the writers whose
    name starts with `writer_prefix` (one collector process: "host:pid:"), over every run."""
    c = IngestCount
    q = (
        select(c.outcome, func.sum(c.batches), func.sum(c.records))
        .where(c.writer.startswith(writer_prefix, autoescape=True))
        .group_by(c.outcome)
    )
    return {outcome: (int(b or 0), int(r or 0)) for outcome, b, r in session.execute(q)}


def ping(session: Session) -> None:
    """One round trip to the database (the liveness probe); raises when it does not answer."""
    session.execute(select(1))
