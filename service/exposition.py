"""Prometheus exposition: a custom Collector over a per-scrape snapshot of live runs.

Series exist only for live runs (running, or finished within a grace period), so a finished or
deleted run leaves no stale series. Every label is bounded whatever agents send: `run` by the
runs exported per project and per scrape (the most severe, then the most recent; the others are
counted in trainvitals_runs_omitted), `layer`, `stage` and open findings by per-run caps (the
snapshot's), `stat`, `outcome`, `role` by fixed sets. docs/metrics.md lists every family and the
worst-case series count.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy.orm import Session

from trainvitals.service.analysis.expectations import MfuExpectation
from trainvitals.service.settings import Settings
from trainvitals.service.store import analysis_status, queries, snapshot
from trainvitals.service.store.models import AnalysisStatus, Run

log = logging.getLogger(__name__)

# Cardinality caps (module constants rather than settings for now; docs/metrics.md derives the
# worst-case series count from them). A scrape reads the store once per exported run (~5 ms on
# PostgreSQL here), so the run caps also bound the scrape time under Prometheus's 10 s timeout.
EXPORTED_RUNS_PER_PROJECT = 50
"""Live runs exported per project: the most severe open finding first, then running before
finished, then stalled before stepping, then the most recently seen."""
EXPORTED_RUNS = 100
"""Live runs exported per scrape over all projects (a scrape without a project's token), in the
same order: without auth, agents name projects freely."""
STALL_FLOOR_SECONDS = 120.0
"""TrainvitalsRunStalled's floor: a running run with no step for this long sorts before the
others of its severity (`_exported_runs`)."""
FP8_LAYERS_PER_RUN = 64
"""Layers in trainvitals_fp8_layer_min_headroom_log2: those with the least headroom, the rest as
layer="other"."""
STAGES_PER_RUN = 64
"""Pipeline stages in trainvitals_run_stage_step_seconds: the slowest, the rest as stage="other"."""
OPEN_FINDINGS_PER_RUN = 50
"""Open findings exported per run: pages first, then tickets; within one, the oldest first."""

ADVICE_TTL_SECONDS = 60.0
# "Not enough to advise yet" is asked again sooner: the first save should show its advice soon.
NO_ADVICE_TTL_SECONDS = 10.0


class TrainvitalsCollector(Collector):
    """Yields every trainvitals_* family from one snapshot of the store per scrape.

    Usage::

        registry = CollectorRegistry()
        registry.register(TrainvitalsCollector(session_factory, settings))
    """

    def __init__(
        self,
        session_factory: Callable[[], Session],
        settings: Settings,
        *,
        clock: Callable[[], float] = time.time,
        mfu_expectation: Callable[[dict[str, object]], MfuExpectation | None] | None = None,
        checkpoint_advice: Callable[..., object] | None = None,
    ) -> None:
        self._session_factory = session_factory
        self._settings = settings
        self._clock = clock
        self._mfu_expectation = mfu_expectation or (lambda _reg: None)
        self._checkpoint_advice = checkpoint_advice
        # Advice moves slowly (saves and failures are rare): recompute at most once a minute per run.
        self._advice_cache: dict[str, tuple[float, object]] = {}

    def describe(self) -> list[Metric]:
        # Returning no descriptions keeps registration from calling collect() (which needs the DB).
        return []

    def collect(self, project: str | None = None) -> Iterator[Metric]:
        now = self._clock()
        s = self._settings
        with self._session_factory() as session:
            runs = queries.live_runs(
                session,
                now=now,
                finished_grace_seconds=s.finished_run_grace_seconds,
                idle_seconds=s.idle_run_seconds,
            )
            if project is not None:
                runs = [r for r in runs if r.project == project]
            severity = snapshot.worst_open_severity(session, run_ids=[r.run_id for r in runs])
            runs, omitted = _exported_runs(runs, severity, now)
            if project is not None:
                omitted.setdefault(project, 0)  # the token's project, even with no live run
            snaps = []
            for r in runs:
                e = self._mfu_expectation(r.registration)
                snaps.append(
                    snapshot.run_snapshot(
                        session,
                        run=r,
                        now=now,
                        top_k=s.top_k,
                        max_groups=s.max_grad_groups,
                        expected_mfu=e.predicted if e else None,
                        expected_mfu_band=(e.low, e.high) if e and e.low is not None and e.high is not None else None,
                        max_layers=FP8_LAYERS_PER_RUN,
                        max_stages=STAGES_PER_RUN,
                        max_findings=OPEN_FINDINGS_PER_RUN,
                    )
                )
            if self._checkpoint_advice is not None:
                for sn, r in zip(snaps, runs, strict=True):
                    sn.checkpoints.advice = self._advice_for(session, r, now)
            counts = queries.ingest_counts(session, project=project)
            analysis = analysis_status.read(session)
        if project is None:
            _label_by_key(snaps)
        yield from _run_families(snaps)
        yield from _omitted_families(omitted)
        yield from _fp8_families(snaps)
        yield from _rank_families(snaps)
        yield from _finding_families(snaps)
        yield from _checkpoint_families(snaps, now)
        yield from _ingest_families(counts, {r.run_id: r.label for r in snaps})
        # The collector's own state, whatever the token: it names no run or project, and the
        # shipped scrape config uses a project's read token.
        yield from _analysis_families(analysis, now)

    def _advice_for(self, session: Session, run: object, now: float) -> object:
        run_id = run.run_id  # type: ignore[attr-defined]
        hit = self._advice_cache.get(run_id)
        if hit is not None and now - hit[0] < (ADVICE_TTL_SECONDS if hit[1] is not None else NO_ADVICE_TTL_SECONDS):
            return hit[1]
        assert self._checkpoint_advice is not None
        try:
            value = self._checkpoint_advice(session, run_id=run_id, registration=run.registration)  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - an advisor's bug must not fail the scrape, and every alert with it
            log.exception("checkpoint advice for run %s failed: /metrics goes on without it", run_id)
            value = None
        if len(self._advice_cache) > 1000:
            self._advice_cache.clear()
        self._advice_cache[run_id] = (now, value)
        return value


def _exported_runs(runs: list[Run], severity: dict[str, int], now: float) -> tuple[list[Run], dict[str, int]]:
    """The live runs /metrics shows, and per project how many it leaves out.

    Order: the most severe open finding, running before finished, a running run with no step for
    STALL_FLOOR_SECONDS before the others (a stalled run stops being seen: by recency alone it
    would be the first left out, and TrainvitalsRunStalled, which reads its series, could not
    fire), the most recently seen, run id.
    At most EXPORTED_RUNS_PER_PROJECT of a project's, EXPORTED_RUNS in all. The omitted counts are
    keyed by project for the projects with an exported run, and by "" for the runs of projects
    with none (so that series is bounded too: one per exported project, plus one).
    """
    ordered = sorted(
        runs,
        key=lambda r: (
            severity.get(r.run_id, snapshot.NO_OPEN_FINDING),
            r.status != "running",
            not (r.status == "running" and r.last_step_at is not None and now - r.last_step_at > STALL_FLOOR_SECONDS),
            -r.last_seen_at,
            r.run_id,
        ),
    )
    live: dict[str, int] = {}
    shown: dict[str, int] = {}
    kept: list[Run] = []
    for r in ordered:
        live[r.project] = live.get(r.project, 0) + 1
        if shown.get(r.project, 0) < EXPORTED_RUNS_PER_PROJECT and len(kept) < EXPORTED_RUNS:
            kept.append(r)
            shown[r.project] = shown.get(r.project, 0) + 1
    omitted = dict.fromkeys(shown, 0)
    for p, n in live.items():
        key = p if p in shown else ""
        omitted[key] = omitted.get(key, 0) + n - shown.get(p, 0)
    return kept, omitted


def _label_by_key(snaps: list[snapshot.RunSnapshot]) -> None:
    """In a scrape of every project (auth off), label each run by its key (the bare run id in the
    default project, `<project>/<run id>` in any other): runs of two projects may share an id
    (registered while auth was on) and must never be one series. Always, not only while two are
    live: a label that changed when another project's run came and went would make every series
    of the run a new one and restart its alerts' `for:`. A project's scrape labels by run id."""
    for sn in snaps:
        sn.label = sn.run_id


def _omitted_families(omitted: dict[str, int]) -> Iterator[Metric]:
    runs = _gauge(
        "trainvitals_runs_omitted",
        "Live runs of a project not exported (beyond the per-project and per-scrape caps); "
        'project="" sums the projects with no exported run',
        ["project"],
    )
    for p, n in sorted(omitted.items()):
        runs.add_metric([p], n)
    yield runs


def _gauge(name: str, doc: str, labels: list[str]) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=labels)


def _run_families(snaps: list[snapshot.RunSnapshot]) -> Iterator[Metric]:
    info = _gauge(
        "trainvitals_run_info",
        "Live runs (value 1) with their project and status",
        ["run", "project", "status"],
    )
    world = _gauge("trainvitals_run_world_size_ranks", "Ranks declared at registration", ["run"])
    reporting = _gauge("trainvitals_run_ranks_reporting", "Ranks in the newest reduced step", ["run"])
    latest = _gauge("trainvitals_run_latest_step", "Highest step delivered by any rank", ["run"])
    complete = _gauge(
        "trainvitals_run_complete_step",
        "Newest step reduced across ranks (the per-step values below are of this step)",
        ["run"],
    )
    since = _gauge(
        "trainvitals_run_seconds_since_last_step",
        "Seconds since the collector last stored a step record of the run (its own clock)",
        ["run"],
    )
    loss = _gauge("trainvitals_run_loss", "Mean training loss over ranks at the complete step", ["run"])
    grad = _gauge(
        "trainvitals_run_grad_norm",
        "Global L2 gradient norm at the complete step (the job's pre-clip total when reported)",
        ["run"],
    )
    nonfinite = _gauge(
        "trainvitals_run_grad_nonfinite_params",
        "Parameters with a non-finite gradient at the complete step",
        ["run"],
    )
    step_time = _gauge(
        "trainvitals_run_rank_step_seconds",
        "Step time across ranks at the complete step (stat: min p50 p90 p99 max)",
        ["run", "stat"],
    )
    wait = _gauge(
        "trainvitals_run_rank_wait_seconds",
        "Median over ranks of the time blocked in gradient collectives at the complete step",
        ["run"],
    )
    data = _gauge(
        "trainvitals_run_rank_data_seconds",
        "Median over ranks of the time waiting for input at the complete step",
        ["run"],
    )
    stage = _gauge(
        "trainvitals_run_stage_step_seconds",
        "Median step time per pipeline stage of the registered pp, the slowest "
        f'{STAGES_PER_RUN} (stage="other": the median over the rest)',
        ["run", "stage"],
    )
    unregistered = _gauge(
        "trainvitals_run_stages_unregistered",
        "Pipeline stage numbers at the complete step outside the registered pp (not exported)",
        ["run"],
    )
    tokens = _gauge(
        "trainvitals_run_tokens_per_second",
        "Tokens per second of the whole job at the complete step",
        ["run"],
    )
    mfu = _gauge(
        "trainvitals_run_mfu_ratio",
        "Measured model FLOPs utilisation over the last 20 reduced steps (0-1)",
        ["run"],
    )
    expected = _gauge(
        "trainvitals_run_mfu_expected_ratio",
        "MFU the advisor's cost model predicts for the run's parallelism config (0-1)",
        ["run"],
    )
    expected_band = _gauge(
        "trainvitals_run_mfu_expected_band_ratio",
        "The cost model's prediction interval for the run's MFU (bound: low, high)",
        ["run", "bound"],
    )
    compute = _gauge(
        "trainvitals_run_rank_compute_seconds",
        "Median over ranks of compute time (step minus waits) at the complete step",
        ["run"],
    )
    loss_nonfinite = _gauge(
        "trainvitals_run_loss_nonfinite_ranks",
        "Ranks that reported a NaN or infinite loss at the complete step",
        ["run"],
    )
    events = CounterMetricFamily(
        "trainvitals_run_events",
        "Run events received by kind, with restart (a rank started again) and rank_lost (a rank "
        "incarnation ended without a clean stop) derived by the collector",
        labels=["run", "event"],
    )
    dropped = CounterMetricFamily(
        "trainvitals_run_agent_dropped_records",
        "Records the run's agents lost for good, by reason (queue_full, spool_full, spool_error, quarantine_full, "
        "quarantine_error, exit_timeout; other: a key this collector does not know), as the agents report them",
        labels=["run", "reason"],
    )
    groups = _gauge(
        "trainvitals_grad_group_norm",
        "L2 gradient norm per parameter group (layer) at the complete step",
        ["run", "group"],
    )
    for sn in snaps:
        r = sn.label
        info.add_metric([r, sn.project, sn.status], 1.0)
        world.add_metric([r], sn.world_size)
        if sn.progress.latest_step is not None:
            latest.add_metric([r], sn.progress.latest_step)
        if sn.progress.seconds_since_last_step is not None:
            since.add_metric([r], sn.progress.seconds_since_last_step)
        if sn.expected_mfu is not None:
            expected.add_metric([r], sn.expected_mfu)
        if sn.expected_mfu_band is not None:
            expected_band.add_metric([r, "low"], sn.expected_mfu_band[0])
            expected_band.add_metric([r, "high"], sn.expected_mfu_band[1])
        for event, n in sorted(sn.events.items()):
            events.add_metric([r, event], n)
        for reason, n in sn.agent_dropped.items():
            dropped.add_metric([r, reason], n)
        if sn.complete.mfu_window is not None:
            mfu.add_metric([r], sn.complete.mfu_window)
        for g, norm in sorted(sn.complete.grad_groups.items()):
            groups.add_metric([r, g], norm)
        s = sn.complete.summary
        if s is None:
            continue
        reporting.add_metric([r], s.ranks)
        complete.add_metric([r], s.step)
        if s.loss is not None:
            loss.add_metric([r], s.loss)
        if s.grad_norm is not None:
            grad.add_metric([r], s.grad_norm)
        nonfinite.add_metric([r], s.grad_nonfinite or 0)
        loss_nonfinite.add_metric([r], s.loss_nonfinite or 0)
        if s.compute_seconds_p50 is not None:
            compute.add_metric([r], s.compute_seconds_p50)
        for stat, value in (
            ("min", s.step_seconds_min),
            ("p50", s.step_seconds_p50),
            ("p90", s.step_seconds_p90),
            ("p99", s.step_seconds_p99),
            ("max", s.step_seconds_max),
        ):
            step_time.add_metric([r, stat], value)
        if s.wait_seconds_p50 is not None:
            wait.add_metric([r], s.wait_seconds_p50)
        if s.data_seconds_p50 is not None:
            data.add_metric([r], s.data_seconds_p50)
        stages = sn.complete.stages
        for st in sorted(stages, key=lambda st: (st == snapshot.OTHER, int(st) if st.isdigit() else 0)):
            stage.add_metric([r, st], stages[st])
        if s.stage_step_seconds_p50:
            unregistered.add_metric([r], sn.complete.stages_unregistered)
        if s.tokens is not None and s.step_seconds_max > 0:
            # Synchronous data parallelism: the job moves at the pace of its slowest rank.
            tokens.add_metric([r], s.tokens / s.step_seconds_max)
    yield from (
        info,
        world,
        reporting,
        latest,
        complete,
        since,
        loss,
        grad,
        nonfinite,
        step_time,
        wait,
        data,
        stage,
        unregistered,
        tokens,
        mfu,
        expected,
        expected_band,
        compute,
        loss_nonfinite,
        events,
        dropped,
        groups,
    )


def _fp8_families(snaps: list[snapshot.RunSnapshot]) -> Iterator[Metric]:
    layer = _gauge(
        "trainvitals_fp8_layer_min_headroom_log2",
        "Minimum FP8 headroom over the tensors of a layer and role, newest step with FP8 stats; the "
        f'{FP8_LAYERS_PER_RUN} layers with the least (layer="other": the least of the rest)',
        ["run", "layer", "role"],
    )
    worst = _gauge(
        "trainvitals_fp8_worst_headroom_log2",
        "FP8 headroom of the top-k tensors with the least headroom (k = settings.top_k)",
        ["run", "tensor", "role"],
    )
    saturated = _gauge(
        "trainvitals_fp8_saturated_tensors",
        "Tensors whose headroom is below 0 bits (largest values clipped)",
        ["run"],
    )
    fp8_step = _gauge("trainvitals_fp8_step", "Newest step with FP8 statistics", ["run"])
    crest = _gauge(
        "trainvitals_fp8_worst_crest_log2",
        "FP8 crest (log2 of amax over median |x|) of the top-k E4M3 tensors with the widest crest, at the "
        "newest step that measured one (k = settings.top_k)",
        ["run", "tensor", "role"],
    )
    crest_step = _gauge("trainvitals_fp8_crest_step", "Newest step with a measured FP8 crest", ["run"])
    for sn in snaps:
        f = sn.fp8
        if f.step is None:
            continue
        fp8_step.add_metric([sn.label], f.step)
        saturated.add_metric([sn.label], f.saturated_tensors)
        for (lay, role), hr in sorted(f.layer_min_headroom.items()):
            layer.add_metric([sn.label, lay, role], hr)
        for tensor, role, hr in f.worst_tensors:
            worst.add_metric([sn.label, tensor, role], hr)
        if f.crest_step is not None:
            crest_step.add_metric([sn.label], f.crest_step)
        for tensor, role, bits in f.worst_crest:
            crest.add_metric([sn.label, tensor, role], bits)
    yield from (layer, worst, saturated, fp8_step, crest, crest_step)


def _rank_families(snaps: list[snapshot.RunSnapshot]) -> Iterator[Metric]:
    slow = _gauge(
        "trainvitals_rank_slowest_compute_seconds",
        "Top-k slowest ranks: mean compute time (step minus collective wait; step time when not split),"
        " newest rank window; host from the rank's start event (empty when unknown)",
        ["run", "rank", "host"],
    )
    ratio = _gauge(
        "trainvitals_rank_slowest_cohort_ratio",
        "Top-k slowest ranks: mean compute time / median of their pipeline-stage cohort",
        ["run", "rank", "host"],
    )
    for sn in snaps:
        for rank, mean, rel in sn.slowest_ranks:
            host = sn.rank_hosts.get(rank, "")
            slow.add_metric([sn.label, str(rank), host], mean)
            ratio.add_metric([sn.label, str(rank), host], rel)
    yield from (slow, ratio)


def _finding_families(snaps: list[snapshot.RunSnapshot]) -> Iterator[Metric]:
    labels = ["run", "kind", "subject_kind", "subject"]
    active = _gauge(
        "trainvitals_finding_active",
        "1 while a detector finding is open",
        ["run", "kind", "severity", "subject_kind", "subject"],
    )
    onset = _gauge("trainvitals_finding_onset_step", "First step of the evidence of an open finding", labels)
    detected = _gauge(
        "trainvitals_finding_detected_step",
        "Complete step at which an open finding was first raised (onset_step is where its evidence starts)",
        labels,
    )
    paged = _gauge(
        "trainvitals_finding_paged_step",
        "Complete step at which an open finding first was a page (absent: it has not paged)",
        labels,
    )
    magnitude = _gauge(
        "trainvitals_finding_magnitude", "Size of an open finding (unit per kind: docs/detectors.md)", labels
    )
    total = CounterMetricFamily(
        "trainvitals_findings", "Distinct findings raised for a live run", labels=["run", "kind", "severity"]
    )
    omitted = _gauge(
        "trainvitals_finding_active_omitted",
        f"Open findings of the run beyond the {OPEN_FINDINGS_PER_RUN} exported (pages first, then the oldest)",
        ["run"],
    )
    for sn in snaps:
        for f in sn.findings.active:
            active.add_metric([sn.label, f.kind, f.severity, f.subject_kind, f.subject], 1.0)
            onset.add_metric([sn.label, f.kind, f.subject_kind, f.subject], f.onset_step)
            if f.detected_step is not None:  # None: stored before revision 0009
                detected.add_metric([sn.label, f.kind, f.subject_kind, f.subject], f.detected_step)
            if f.paged_step is not None:  # a ticket that never escalated, or stored before revision 0020
                paged.add_metric([sn.label, f.kind, f.subject_kind, f.subject], f.paged_step)
            magnitude.add_metric([sn.label, f.kind, f.subject_kind, f.subject], f.magnitude)
        for (kind, severity), n in sorted(sn.findings.by_kind.items()):
            total.add_metric([sn.label, kind, severity], n)
        omitted.add_metric([sn.label], sn.findings.omitted)
    yield from (active, onset, detected, paged, magnitude, total, omitted)


def _checkpoint_families(snaps: list[snapshot.RunSnapshot], now: float) -> Iterator[Metric]:
    step = _gauge(
        "trainvitals_checkpoint_last_persisted_step", "Step of the newest persisted checkpoint", ["run"]
    )
    age = _gauge(
        "trainvitals_checkpoint_last_persisted_age_seconds",
        "Seconds since the newest persisted checkpoint",
        ["run"],
    )
    advised = _gauge(
        "trainvitals_checkpoint_recommended_interval_seconds",
        "Checkpoint interval the cadence advisor recommends from observed saves and failures",
        ["run"],
    )
    band = _gauge(
        "trainvitals_checkpoint_interval_band_seconds",
        "Flat-basin band around the recommended interval (waste within 5%)",
        ["run", "bound"],
    )
    stall = _gauge(
        "trainvitals_checkpoint_last_stall_seconds",
        "Training blocked by the save of the newest persisted checkpoint (slowest rank)",
        ["run"],
    )
    persist = _gauge(
        "trainvitals_checkpoint_last_persist_seconds",
        "Time until the newest persisted checkpoint was durable (slowest rank)",
        ["run"],
    )
    records = _gauge(
        "trainvitals_checkpoint_records",
        "Checkpoint records by status (started, persisted, verified, failed; deleted: its files gone since)",
        ["run", "status"],
    )
    for sn in snaps:
        c = sn.checkpoints
        if c.last_persisted_step is not None:
            step.add_metric([sn.label], c.last_persisted_step)
            age.add_metric([sn.label], max(0.0, now - (c.last_persisted_ts or now)))
        if c.last_stall_seconds is not None:
            stall.add_metric([sn.label], c.last_stall_seconds)
        if c.last_persist_seconds is not None:
            persist.add_metric([sn.label], c.last_persist_seconds)
        for status, n in sorted(c.status_counts.items()):
            records.add_metric([sn.label, status], n)
        a = c.advice
        if a is not None:
            advised.add_metric([sn.label], a.recommended_interval_s)
            band.add_metric([sn.label, "low"], a.band_s[0])
            band.add_metric([sn.label, "high"], a.band_s[1])
    yield from (step, age, stall, persist, records, advised, band)


def make_registry(collector: TrainvitalsCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def _ingest_families(counts: list[queries.IngestCountRow], live: dict[str, str]) -> Iterator[Metric]:
    """live: the exported runs' labels by key."""
    records = CounterMetricFamily(
        "trainvitals_ingest_records",
        "Records stored, per live run (all collector processes sharing the database)",
        labels=["run"],
    )
    stored: dict[str, int] = {}
    by_outcome: dict[str, int] = {"stored": 0, "duplicate": 0, "rejected": 0}
    for row in counts:
        by_outcome[row.outcome] = by_outcome.get(row.outcome, 0) + row.batches
        if row.outcome == "stored" and row.run_id in live:
            label = live[row.run_id]
            stored[label] = stored.get(label, 0) + row.records
    for run, n in sorted(stored.items()):
        records.add_metric([run], n)
    outcome = CounterMetricFamily(
        "trainvitals_ingest_batches",
        "Batches received, by outcome (all collector processes sharing the database)",
        labels=["outcome"],
    )
    for name, n in sorted(by_outcome.items()):
        outcome.add_metric([name], n)
    yield records
    yield outcome


def _analysis_families(status: AnalysisStatus | None, now: float) -> Iterator[Metric]:
    cycles = CounterMetricFamily(
        "trainvitals_analysis_cycles", "Analysis cycles run (reduce + detect over every live run)"
    )
    seconds = CounterMetricFamily(
        "trainvitals_analysis_cycle_seconds",
        "Seconds spent in analysis cycles (rate over the cycles' rate: the mean cycle time)",
    )
    errors = CounterMetricFamily(
        "trainvitals_analysis_errors", "Runs whose analysis raised in a cycle, and failed cycles (retried; logged)"
    )
    last = _gauge("trainvitals_analysis_last_cycle_seconds", "Duration of the newest analysis cycle", [])
    since = _gauge(
        "trainvitals_analysis_seconds_since_last_cycle",
        "Seconds since the newest analysis cycle ended (grows when no process analyses)",
        [],
    )
    # Zero before the first cycle: the counters exist from the start, so rate() and increase() work.
    cycles.add_metric([], status.cycles if status else 0)
    seconds.add_metric([], status.cycle_seconds_total if status else 0.0)
    errors.add_metric([], status.errors if status else 0)
    if status is not None:
        if status.last_cycle_seconds is not None:
            last.add_metric([], status.last_cycle_seconds)
        if status.last_cycle_at is not None:
            since.add_metric([], max(0.0, now - status.last_cycle_at))
    yield from (cycles, seconds, errors, last, since)
