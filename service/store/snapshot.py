"""What /metrics shows of one live run, read from the summary tables with bounded work per scrape.

One function per section of the exposition (service/exposition.py has one family group each):

- `progress`: newest delivered step and its age (two index probes);
- `complete_step`: the newest reduced step, the window MFU, the per-group gradient norms (the
  newest `mfu_window_steps` step summaries, one step of group norms) and the per-stage step times;
- `fp8_headroom`: the newest step with FP8 statistics (one step of tensor summaries);
- `slowest_ranks`: the top-k of the newest rank window;
- `open_findings`: active findings and counts by kind;
- `checkpoint_status`: the newest persisted checkpoint (its step, time, stall and persist
  seconds) and record counts by status;
- `run_events`: events received by kind, restarts and ranks lost (the events table);
- `rank_hosts`: the host of each of the top-k slowest ranks (their start events);
- `worst_open_severity`: each live run's most severe open finding (which runs /metrics keeps).

Label values an agent chooses (layer names, pipeline stage numbers) and open findings are capped
per run here: the most severe first, the rest summarised as one `OTHER` series or counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sqlalchemy import case, func, select
from sqlalchemy.orm import Session

from trainvitals.service.store import run_keys
from trainvitals.service.store.models import (
    CheckpointRow,
    EventRow,
    FindingRow,
    GradSummary,
    RankWindow,
    Run,
    StepRow,
    StepSummary,
    TensorSummary,
)
from trainvitals.wire.conventions import DROP_REASONS, GLOBAL_GROUP, layer_of

OTHER = "other"
"""Label value (`layer`, `stage`) of the one series that summarises what a per-run cap leaves out."""

SEVERITY_RANK = {"page": 0, "ticket": 1, "info": 2}
"""Most severe first; a run without open findings ranks after every one with some."""
NO_OPEN_FINDING = len(SEVERITY_RANK)


@dataclass(kw_only=True, slots=True)
class Progress:
    latest_step: int | None = None
    """Highest step delivered by any rank (raw rows: ahead of the reduction)."""
    seconds_since_last_step: float | None = None


@dataclass(kw_only=True, slots=True)
class CompleteStep:
    summary: StepSummary | None = None
    """The newest reduced step (None before the first reduction)."""
    mfu_window: float | None = None
    """MFU over the newest reduced steps: total FLOPs / total (time x peak)."""
    grad_groups: dict[str, float] = field(default_factory=dict)
    """Gradient norm per parameter group at that step (the largest `max_groups`)."""
    stages: dict[str, float] = field(default_factory=dict)
    """Median step time per pipeline stage at that step, as exported (see `pipeline_stages`)."""
    stages_unregistered: int = 0
    """Stage numbers at that step outside the registered pp (0..pp-1), left out of `stages`."""


@dataclass(kw_only=True, slots=True)
class Fp8Headroom:
    step: int | None = None
    """Newest step with FP8 statistics (None: the run has none)."""
    layer_min_headroom: dict[tuple[str, str], float] = field(default_factory=dict)
    """(layer, role) -> least headroom over that layer's tensors; past `max_layers` layers, the
    layers with the least headroom and (OTHER, role) for the rest (see `cap_layers`)."""
    worst_tensors: list[tuple[str, str, float]] = field(default_factory=list)
    """(tensor, role, headroom) of the top-k tensors with the least headroom."""
    saturated_tensors: int = 0
    """Tensors with headroom below 0 bits."""
    crest_step: int | None = None
    """Newest step with a measured crest (the agent's expensive steps; None: none yet)."""
    worst_crest: list[tuple[str, str, float]] = field(default_factory=list)
    """(tensor, role, crest bits) of the top-k E4M3 tensors with the widest crest at `crest_step`:
    what fp8_precision_crest judges (E5M2 has 15 bits more range below, and is not judged)."""


@dataclass(kw_only=True, slots=True)
class OpenFindings:
    active: list[FindingRow] = field(default_factory=list)
    """Open findings, most severe first, then oldest first (at most `max_active`)."""
    omitted: int = 0
    """Open findings beyond `max_active`, not in `active`."""
    by_kind: dict[tuple[str, str], int] = field(default_factory=dict)
    """(kind, severity) -> findings ever raised, active or not."""


@dataclass(kw_only=True, slots=True)
class CheckpointStatus:
    last_persisted_step: int | None = None
    last_persisted_ts: float | None = None
    last_stall_seconds: float | None = None
    """Training blocked by the save of the newest persisted generation (slowest rank)."""
    last_persist_seconds: float | None = None
    """Until that generation was durable (slowest rank; async saves persist after the stall)."""
    status_counts: dict[str, int] = field(default_factory=dict)
    """Records by status (started, persisted, failed, verified)."""
    advice: Any = None
    """CadenceAdvice for the run's observed saves/failures, when there is enough to advise (set by
    the exposition collector, which caches it: it is not read from the store)."""


@dataclass(kw_only=True, slots=True)
class RunSnapshot:
    run_id: str
    """The run's key (store/run_keys.py)."""
    label: str
    """Its `run` label: the run id (exposition.py makes it the key in a scrape of every project)."""
    project: str
    status: str
    world_size: int
    expected_mfu: float | None = None
    expected_mfu_band: tuple[float, float] | None = None
    """The prediction interval of `expected_mfu` (low, high), when the model gives one."""
    progress: Progress = field(default_factory=Progress)
    complete: CompleteStep = field(default_factory=CompleteStep)
    fp8: Fp8Headroom = field(default_factory=Fp8Headroom)
    slowest_ranks: list[tuple[int, float, float]] = field(default_factory=list)
    """(rank, mean compute seconds -- step seconds when not measured --, ratio to its cohort's
    median) in the newest rank window, slowest first."""
    rank_hosts: dict[int, str] = field(default_factory=dict)
    """Host of each of the slowest ranks (from its newest start event), where known."""
    events: dict[str, int] = field(default_factory=dict)
    """Run events by kind (see `run_events`)."""
    agent_dropped: dict[str, int] = field(default_factory=dict)
    """Records the run's agents lost, by reason (see `agent_dropped`)."""
    findings: OpenFindings = field(default_factory=OpenFindings)
    checkpoints: CheckpointStatus = field(default_factory=CheckpointStatus)


def run_snapshot(
    session: Session,
    *,
    run: Run,
    now: float,
    top_k: int,
    max_groups: int,
    mfu_window_steps: int = 20,
    expected_mfu: float | None = None,
    expected_mfu_band: tuple[float, float] | None = None,
    max_layers: int | None = None,
    max_stages: int | None = None,
    max_findings: int | None = None,
) -> RunSnapshot:
    """Everything /metrics shows of `run`. The caps (None: no cap) bound its series whatever its
    agents send: FP8 layers, pipeline stages and open findings exported."""
    rid = run.run_id
    slowest = slowest_ranks(session, run_id=rid, top_k=top_k)
    return RunSnapshot(
        run_id=rid,
        label=run_keys.run_id_of(rid),
        project=run.project,
        status=run.status,
        world_size=run.world_size,
        expected_mfu=expected_mfu,
        expected_mfu_band=expected_mfu_band,
        progress=progress(session, run_id=rid, now=now, last_step_at=run.last_step_at),
        complete=complete_step(
            session,
            run_id=rid,
            mfu_window_steps=mfu_window_steps,
            max_groups=max_groups,
            pp=registered_pp(run.registration),
            max_stages=max_stages,
        ),
        fp8=fp8_headroom(session, run_id=rid, top_k=top_k, max_layers=max_layers),
        slowest_ranks=slowest,
        rank_hosts=rank_hosts(session, run_id=rid, ranks=[r for r, _, _ in slowest]),
        events=run_events(session, run_id=rid),
        agent_dropped=agent_dropped(session, run_id=rid),
        findings=open_findings(session, run_id=rid, max_active=max_findings),
        checkpoints=checkpoint_status(session, run_id=rid),
    )


def progress(session: Session, *, run_id: str, now: float, last_step_at: float | None = None) -> Progress:
    """The newest step and the age of the newest work: since the collector last stored a step
    record of the run (`runs.last_step_at`, its own clock: the agents' clocks may differ from it).
    Not the newest step's own end time: a job relaunched from a checkpoint replays steps below the
    newest one, which would age from the crash until the new incarnation passed it (a stall page
    for a run that trains). That end time only where last_step_at is NULL (no step record since
    revision 0018)."""
    # Raw steps grow by world_size rows per step: max(ts) over the whole run is a scan of millions
    # of rows at 16,384 ranks. The newest step comes off the (run_id, step, rank) index, and the
    # newest timestamp is taken among that step's rows (at most world_size of them).
    out = Progress(latest_step=session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == run_id)))
    if last_step_at is not None:
        out.seconds_since_last_step = max(0.0, now - last_step_at)
    elif (last_ts := newest_step_end(session, run_id=run_id, step=out.latest_step)) is not None:
        out.seconds_since_last_step = max(0.0, now - last_ts)
    return out


def newest_step_end(session: Session, *, run_id: str, step: int | None = -1) -> float | None:
    """When the newest step ended, by its ranks' clocks: the newest timestamp among the rows of
    `step` (-1: the run's newest step; None: no step). Off the (run_id, step, rank) index, at most
    world_size rows: max(ts) over the run would scan millions at 16,384 ranks."""
    if step == -1:
        step = session.scalar(select(func.max(StepRow.step)).where(StepRow.run_id == run_id))
    if step is None:
        return None
    return session.scalar(select(func.max(StepRow.ts)).where(StepRow.run_id == run_id, StepRow.step == step))


def window_mfu(recent: Iterable[StepSummary]) -> float | None:
    """MFU of a window of step summaries: total FLOPs over total (time x peak), not a mean of
    per-step ratios; the steps without a measured MFU are left out. Reads the peak the reduction
    stored with each step."""
    flops = time_x_peak = 0.0
    for s in recent:
        if s.flops and s.mfu and s.peak_flops_total:
            flops += s.flops
            time_x_peak += s.step_seconds_max * s.peak_flops_total
    return flops / time_x_peak if time_x_peak else None


def registered_pp(registration: dict[str, Any] | None) -> int:
    """The pipeline-parallel degree the run registered (1 when it declared none)."""
    return int(((registration or {}).get("parallelism") or {}).get("pp") or 1)


def complete_step(
    session: Session,
    *,
    run_id: str,
    mfu_window_steps: int,
    max_groups: int,
    pp: int | None = None,
    max_stages: int | None = None,
) -> CompleteStep:
    recent = list(
        session.scalars(
            select(StepSummary)
            .where(StepSummary.run_id == run_id)
            .order_by(StepSummary.step.desc())
            .limit(mfu_window_steps)
        )
    )
    if not recent:
        return CompleteStep()
    # The largest norms when a run has more groups than exported (a sort of one step's groups).
    groups = session.execute(
        select(GradSummary.group_name, GradSummary.norm)
        .where(GradSummary.run_id == run_id, GradSummary.step == recent[0].step, GradSummary.group_name != GLOBAL_GROUP)
        .order_by(GradSummary.norm.desc(), GradSummary.group_name)
        .limit(max_groups)
    ).all()
    stages, unregistered = pipeline_stages(recent[0].stage_step_seconds_p50 or {}, pp=pp, max_stages=max_stages)
    return CompleteStep(
        summary=recent[0],
        mfu_window=window_mfu(recent),
        grad_groups={g: n for g, n in groups},
        stages=stages,
        stages_unregistered=unregistered,
    )


def pipeline_stages(
    p50: dict[str, float], *, pp: int | None, max_stages: int | None
) -> tuple[dict[str, float], int]:
    """Median step time per stage as exported, and the number of stages left out as unregistered.

    Only stages 0..pp-1 of the registration (None: any): another stage number is an agent's
    mistake, counted rather than exported. Past `max_stages` stages, the slowest `max_stages`
    and one OTHER series, the median over the rest (what a typical other stage takes).
    """
    valid: dict[str, float] = {}
    unregistered = 0
    for stage, seconds in p50.items():
        if pp is not None and not 0 <= int(stage) < pp:  # keys are str(pp_stage), written by the reduction
            unregistered += 1
        else:
            valid[stage] = seconds
    if max_stages is None or len(valid) <= max_stages:
        return valid, unregistered
    slowest = sorted(valid, key=lambda st: (-valid[st], int(st)))
    out = {st: valid[st] for st in slowest[:max_stages]}
    out[OTHER] = float(np.median([valid[st] for st in slowest[max_stages:]]))
    return out, unregistered


def fp8_headroom(session: Session, *, run_id: str, top_k: int, max_layers: int | None = None) -> Fp8Headroom:
    step = session.scalar(select(func.max(TensorSummary.step)).where(TensorSummary.run_id == run_id))
    if step is None:
        return Fp8Headroom()
    out = Fp8Headroom(step=step)
    rows = [
        (tensor, role, hr)
        for tensor, role, hr in session.execute(
            select(TensorSummary.tensor, TensorSummary.role, TensorSummary.headroom_bits).where(
                TensorSummary.run_id == run_id,
                TensorSummary.step == step,
                TensorSummary.headroom_bits.is_not(None),
            )
        )
        if hr is not None  # for the type checker: the query asks for it already
    ]
    per_layer: dict[tuple[str, str], float] = {}
    for tensor, role, hr in rows:
        key = (layer_of(tensor), role)
        per_layer[key] = min(hr, per_layer.get(key, np.inf))
        if hr < 0:
            out.saturated_tensors += 1
    out.layer_min_headroom = cap_layers(per_layer, max_layers=max_layers)
    out.worst_tensors = sorted(rows, key=lambda x: x[2])[:top_k]
    out.crest_step, out.worst_crest = _worst_crest(session, run_id=run_id, top_k=top_k)
    return out


def _worst_crest(session: Session, *, run_id: str, top_k: int) -> tuple[int | None, list[tuple[str, str, float]]]:
    """The newest step with a measured crest and its top-k E4M3 tensors by crest, widest first.
    The first read seeks the partial index of the measured rows (models.TensorSummary); the second
    reads that one step's rows."""
    measured = (TensorSummary.run_id == run_id, TensorSummary.crest_bits.is_not(None))
    step = session.scalar(select(func.max(TensorSummary.step)).where(*measured))
    if step is None:
        return None, []
    rows = session.execute(
        select(TensorSummary.tensor, TensorSummary.role, TensorSummary.crest_bits).where(
            *measured, TensorSummary.step == step, TensorSummary.format == "e4m3"
        )
    )
    finite = [(tensor, role, crest) for tensor, role, crest in rows if crest is not None and math.isfinite(crest)]
    return step, sorted(finite, key=lambda x: (-x[2], x[0], x[1]))[:top_k]


def cap_layers(
    per_layer: dict[tuple[str, str], float], *, max_layers: int | None
) -> dict[tuple[str, str], float]:
    """(layer, role) -> least headroom, for at most `max_layers` layers: those with the least
    headroom over their roles, with every role of theirs, and (OTHER, role) the least headroom of
    the rest. A real layer named OTHER is among the rest then, so no two series share labels."""
    least: dict[str, float] = {}
    for (layer, _role), hr in per_layer.items():
        least[layer] = min(hr, least.get(layer, np.inf))
    if max_layers is None or len(least) <= max_layers:
        return per_layer
    kept = set(sorted((lay for lay in least if lay != OTHER), key=lambda lay: (least[lay], lay))[:max_layers])
    out: dict[tuple[str, str], float] = {}
    for (layer, role), hr in per_layer.items():
        key = (layer, role) if layer in kept else (OTHER, role)
        out[key] = min(hr, out.get(key, np.inf))
    return out


def slowest_ranks(session: Session, *, run_id: str, top_k: int) -> list[tuple[int, float, float]]:
    newest_window = session.scalar(
        select(func.max(RankWindow.window_start)).where(RankWindow.run_id == run_id, RankWindow.steps > 1)
    )
    if newest_window is None:
        return []
    win = session.execute(
        # Compute time (step minus collective wait) when measured: in synchronous training every
        # rank's step lasts as long as the slowest one's, so step time cannot single it out.
        select(
            RankWindow.rank,
            func.coalesce(RankWindow.compute_seconds_mean, RankWindow.step_seconds_mean),
            RankWindow.pp_stage,
        ).where(RankWindow.run_id == run_id, RankWindow.window_start == newest_window)
    ).all()
    cohort: dict[int | None, list[float]] = {}
    for _rank, mean, stage in win:
        cohort.setdefault(stage, []).append(mean)
    medians = {k: float(np.median(v)) for k, v in cohort.items()}
    ranked = sorted(((r, m, m / medians[s] if medians[s] > 0 else 1.0) for r, m, s in win), key=lambda x: -x[2])
    return ranked[:top_k]


def _severity_rank() -> Any:
    return case(SEVERITY_RANK, value=FindingRow.severity, else_=NO_OPEN_FINDING)


def open_findings(session: Session, *, run_id: str, max_active: int | None = None) -> OpenFindings:
    """Open findings, most severe first and, within a severity, oldest first: an exported finding
    stays exported while it is open (a newer one does not push it out), so its alert does not flap."""
    is_open = (FindingRow.run_id == run_id) & FindingRow.active.is_(True)
    active = list(
        session.scalars(
            select(FindingRow)
            .where(is_open)
            .order_by(_severity_rank(), FindingRow.first_seen_at, FindingRow.id)
            .limit(max_active)
        )
    )
    omitted = 0
    if max_active is not None and len(active) == max_active:
        omitted = int(session.scalar(select(func.count()).select_from(FindingRow).where(is_open)) or 0) - max_active
    return OpenFindings(
        active=active,
        omitted=omitted,
        by_kind={
            (k, s): n
            for k, s, n in session.execute(
                select(FindingRow.kind, FindingRow.severity, func.count())
                .where(FindingRow.run_id == run_id)
                .group_by(FindingRow.kind, FindingRow.severity)
            )
        },
    )


def checkpoint_status(session: Session, *, run_id: str) -> CheckpointStatus:
    out = CheckpointStatus()
    # One ordered probe per status rather than `status IN (...) ORDER BY step DESC`: with the
    # (run_id, status, step) index each probe reads one index entry, whereas the IN form has to
    # sort every persisted row of every rank (world_size rows per generation).
    newest = [
        row
        for status in ("persisted", "verified")
        if (
            row := session.execute(
                select(CheckpointRow.step, CheckpointRow.ts)
                .where(CheckpointRow.run_id == run_id, CheckpointRow.status == status)
                .order_by(CheckpointRow.step.desc())
                .limit(1)
            ).first()
        )
        is not None
    ]
    if newest:
        out.last_persisted_step, out.last_persisted_ts = max(newest, key=lambda r: r[0])
        # That generation's rows (one per rank, found by the (run_id, status, step) index): the
        # job waits for its slowest rank, so the stall and persist times are the maxima.
        out.last_stall_seconds, out.last_persist_seconds = session.execute(
            select(func.max(CheckpointRow.stall_seconds), func.max(CheckpointRow.persist_seconds)).where(
                CheckpointRow.run_id == run_id,
                CheckpointRow.status.in_(("persisted", "verified")),
                CheckpointRow.step == out.last_persisted_step,
            )
        ).one()
    out.status_counts = dict(
        session.execute(
            select(CheckpointRow.status, func.count())
            .where(CheckpointRow.run_id == run_id)
            .group_by(CheckpointRow.status)
        ).all()
    )
    return out


def run_events(session: Session, *, run_id: str) -> dict[str, int]:
    """Events received by kind, with two the collector derives (every value only grows):

    - `restart`: a start from a rank that had started before (a new incarnation: the job or the rank
      was relaunched), plus any `restart` event sent as such; `start` then counts ranks, once each;
    - `rank_lost`: rank incarnations that ended without a clean `stop` (a newer incarnation of the
      rank started since): a crash, a kill, or a relaunch that took healthy ranks down with it. An
      incarnation that sent a `failure` is lost even if its agent then closed (and sent `stop`).
      A rank that is silent now but not yet relaunched shows as ranks missing from the complete
      step instead (it may still come back).

    Cost: one grouped count, and the start/stop/failure rows (a few per rank and incarnation).
    """
    out = {
        event: int(n)
        for event, n in session.execute(
            select(EventRow.event, func.count()).where(EventRow.run_id == run_id).group_by(EventRow.event)
        )
    }
    seen: dict[int, dict[int, set[str]]] = {}  # rank -> incarnation -> its start/stop/failure events
    for rank, incarnation, event in session.execute(
        select(EventRow.rank, EventRow.incarnation, EventRow.event).where(
            EventRow.run_id == run_id, EventRow.event.in_(("start", "stop", "failure"))
        )
    ):
        seen.setdefault(rank, {}).setdefault(incarnation, set()).add(event)
    starts = out.pop("start", 0)
    if starts:
        out["start"] = len(seen)
        out["restart"] = out.get("restart", 0) + starts - len(seen)
    out["rank_lost"] = sum(
        "stop" not in events or "failure" in events
        for incarnations in seen.values()
        for inc, events in incarnations.items()
        if inc < max(incarnations)
    )
    return out


def agent_dropped(session: Session, *, run_id: str) -> dict[str, int]:
    """Records the run's agents lost for good, by reason (wire DROP_REASONS, any other key under
    'other'), every reason present (0: none lost). An agent's 'dropped' event carries its
    cumulative counts, so each rank incarnation counts with its largest; the incarnations and
    ranks add up. Cost: the 'dropped' event rows, at most one per rank and send interval, and only
    while an agent is losing records."""
    newest: dict[tuple[int, int, str], int] = {}
    for rank, incarnation, domains in session.execute(
        select(EventRow.rank, EventRow.incarnation, EventRow.domains).where(
            EventRow.run_id == run_id, EventRow.event == "dropped"
        )
    ):
        for key, value in (domains or {}).items():
            try:
                n = int(value)
            except ValueError:  # not a count: nothing to add (the event's detail still says it)
                continue
            k = (rank, incarnation, key)
            newest[k] = max(newest.get(k, 0), n)
    out = dict.fromkeys((*DROP_REASONS, "other"), 0)
    for (_rank, _incarnation, key), n in newest.items():
        out[key if key in DROP_REASONS else "other"] += max(n, 0)
    return out


def rank_hosts(session: Session, *, run_id: str, ranks: list[int]) -> dict[int, str]:
    """Host of each rank in `ranks`, from its newest start event: `domains["host"]` (agents since
    the host label), else the `host=...` word of the start event's detail (older agents)."""
    if not ranks:
        return {}
    out: dict[int, str] = {}
    for rank, domains, detail in session.execute(
        select(EventRow.rank, EventRow.domains, EventRow.detail)
        .where(EventRow.run_id == run_id, EventRow.event == "start", EventRow.rank.in_(ranks))
        .order_by(EventRow.incarnation)
    ):
        host = (domains or {}).get("host") or next(
            (w[5:] for w in (detail or "").split() if w.startswith("host=")), None
        )
        if host:
            out[rank] = host  # ordered by incarnation: the newest start wins
    return out


def worst_open_severity(session: Session, *, run_ids: list[str]) -> dict[str, int]:
    """Run id -> SEVERITY_RANK of its most severe open finding (runs without one are absent).
    One grouped query per 1,000 runs (an IN list of bounded size on both backends)."""
    out: dict[str, int] = {}
    for i in range(0, len(run_ids), 1000):
        rows = session.execute(
            select(FindingRow.run_id, func.min(_severity_rank()))
            .where(FindingRow.run_id.in_(run_ids[i : i + 1000]), FindingRow.active.is_(True))
            .group_by(FindingRow.run_id)
        )
        out.update((run_id, int(rank)) for run_id, rank in rows)
    return out
