"""Prometheus exposition: a custom Collector over a per-scrape snapshot of live runs.

Series exist only for live runs (running, or finished within a grace period), so a finished or
deleted run leaves no stale series. Labels are bounded: `run` (live runs), `stat` (fixed set),
`outcome` (fixed set). docs/metrics.md lists every family.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from threading import Lock

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry
from sqlalchemy.orm import Session
from trainvitals.service.settings import Settings
from trainvitals.service.store import queries

# Cross-rank statistics of the step time. Not a `quantile` label: promtool reserves that for
# summaries, whose count/sum are cumulative, which a distribution over ranks is not.
STEP_TIME_STATS = (("min", 0.0), ("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))


class IngestCounters:
    """Process-local ingest counters, updated by the ingest route (thread-safe, O(1))."""

    def __init__(self) -> None:
        self._lock = Lock()
        self.records_by_run: dict[str, int] = {}
        self.batches_by_outcome: dict[str, int] = {"stored": 0, "duplicate": 0, "rejected": 0}

    def count_batch(self, *, run: str | None, outcome: str, records: int = 0) -> None:
        with self._lock:
            self.batches_by_outcome[outcome] = self.batches_by_outcome.get(outcome, 0) + 1
            if run is not None and records:
                self.records_by_run[run] = self.records_by_run.get(run, 0) + records

    def snapshot(self) -> tuple[dict[str, int], dict[str, int]]:
        with self._lock:
            return dict(self.records_by_run), dict(self.batches_by_outcome)


def quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an already sorted list (numpy's default method)."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


class TrainvitalsCollector(Collector):
    """Yields every trainvitals_* family from one snapshot of the store per scrape.

    Usage::

        registry = CollectorRegistry()
        registry.register(TrainvitalsCollector(session_factory, settings, counters))
    """

    def __init__(
        self,
        session_factory: Callable[[], Session],
        settings: Settings,
        counters: IngestCounters,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._session_factory = session_factory
        self._settings = settings
        self._counters = counters
        self._clock = clock

    def describe(self) -> list[Metric]:
        # Returning no descriptions keeps registration from calling collect() (which needs the DB).
        return []

    def collect(self) -> Iterator[Metric]:
        with self._session_factory() as session:
            runs = queries.live_runs(
                session,
                now=self._clock(),
                finished_grace_seconds=self._settings.finished_run_grace_seconds,
                idle_seconds=self._settings.idle_run_seconds,
            )
            latest = [queries.run_latest(session, run=run) for run in runs]
        yield from self._run_families(latest)
        yield from self._ingest_families({r.run_id for r in latest})

    def _run_families(self, latest: list[queries.RunLatest]) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            "trainvitals_run_info",
            "Live runs (value 1) with their project and status",
            labels=["run", "project", "status"],
        )
        world = GaugeMetricFamily(
            "trainvitals_run_world_size_ranks", "Ranks declared at registration", labels=["run"]
        )
        reporting = GaugeMetricFamily(
            "trainvitals_run_ranks_reporting", "Ranks that delivered the newest complete step", labels=["run"]
        )
        step = GaugeMetricFamily(
            "trainvitals_run_latest_step", "Highest step delivered by any rank", labels=["run"]
        )
        complete = GaugeMetricFamily(
            "trainvitals_run_complete_step",
            "Newest step delivered by every reporting rank (the values below)",
            labels=["run"],
        )
        loss = GaugeMetricFamily(
            "trainvitals_run_loss", "Mean training loss over ranks at the complete step", labels=["run"]
        )
        grad = GaugeMetricFamily(
            "trainvitals_run_grad_norm", "Global L2 gradient norm at the complete step", labels=["run"]
        )
        step_time = GaugeMetricFamily(
            "trainvitals_run_rank_step_seconds",
            "Step time across ranks at the complete step (stat: min p50 p90 p99 max)",
            labels=["run", "stat"],
        )
        tokens = GaugeMetricFamily(
            "trainvitals_run_tokens_per_second",
            "Tokens per second of the whole job at the complete step",
            labels=["run"],
        )
        for r in latest:
            info.add_metric([r.run_id, r.project, r.status], 1.0)
            world.add_metric([r.run_id], r.world_size)
            reporting.add_metric([r.run_id], r.ranks_reporting)
            if r.latest_step is None or r.complete_step is None:
                continue
            step.add_metric([r.run_id], r.latest_step)
            complete.add_metric([r.run_id], r.complete_step)
            if r.loss is not None:
                loss.add_metric([r.run_id], r.loss)
            if r.grad_norm is not None:
                grad.add_metric([r.run_id], r.grad_norm)
            for stat, q in STEP_TIME_STATS:
                step_time.add_metric([r.run_id, stat], quantile(r.step_seconds, q))
            slowest = r.step_seconds[-1]
            if r.tokens is not None and slowest > 0:
                # Synchronous data parallelism: the job moves at the pace of its slowest rank.
                tokens.add_metric([r.run_id], r.tokens / slowest)
        yield from (info, world, reporting, step, complete, loss, grad, step_time, tokens)

    def _ingest_families(self, live: set[str]) -> Iterator[Metric]:
        records_by_run, batches = self._counters.snapshot()
        records = CounterMetricFamily(
            "trainvitals_ingest_records",
            "Records stored by this collector process, per live run",
            labels=["run"],
        )
        for run, n in sorted(records_by_run.items()):
            if run in live:
                records.add_metric([run], n)
        outcome = CounterMetricFamily(
            "trainvitals_ingest_batches",
            "Batches received by this collector process, by outcome",
            labels=["outcome"],
        )
        for name, n in sorted(batches.items()):
            outcome.add_metric([name], n)
        yield records
        yield outcome


def make_registry(collector: TrainvitalsCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
