"""The collector's metrics about itself, per process: request latency, refusals by reason, and the
batch writer's queue. (The analysis worker's cycle times and errors come from the database instead,
`store/analysis_status.py`: it usually runs in a process of its own.)

Prometheus scrapes each collector process (`instance`): sum these over instances, whereas the
families read from the database are the same in every process and are taken with `max`.

`RequestMetrics` is plain ASGI, outermost, so it also times and counts what is refused before a
route runs (413 from BodyLimit, 401, 422 from validation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Routes that take data from agents: their refusals are counted by reason.
INGEST_ROUTES = frozenset({("POST", "/v1/batches"), ("POST", "/v1/runs")})

# Status -> reason, unless the route said more precisely (`refuse(request, reason)`).
_REASON_BY_STATUS = {
    401: "unauthenticated",
    403: "forbidden",
    409: "conflict",
    413: "too_large",
    422: "invalid",
    503: "busy",
}
REFUSAL_REASONS = (
    "unauthenticated", "forbidden", "unknown_run", "conflict", "too_large", "invalid", "unstorable", "busy",
    "busy_large", "storage_error", "other",
)  # fmt: skip
_REASON_KEY = "refusal_reason"  # in the ASGI scope state, set by refuse()

# Seconds: a small batch is answered in milliseconds; a group commit under load takes up to seconds.
_BUCKETS = (0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# A group's transaction: about 1-40 ms under load on 2 cores (docs/performance.md), seconds when the
# database stalls.
_GROUP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_GROUP_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# Every family ProcessMetrics exports (counters without `_total`). They differ between processes and
# replicas by design: benchmarks/scaleout_16k.py compares replicas' /metrics without them.
FAMILIES = (
    "trainvitals_http_request_duration_seconds",
    "trainvitals_http_requests",
    "trainvitals_ingest_refused",
    "trainvitals_ingest_group_write_duration_seconds",
    "trainvitals_ingest_group_batches",
    "trainvitals_ingest_queue_records",
    "trainvitals_ingest_queue_limit_records",
    "trainvitals_ingest_writer_threads",
    "trainvitals_ingest_writers_busy_ratio",
    "trainvitals_ingest_journal_acks",
)
BUSY_WINDOW_S = 60


def busy_share(seconds: float, threads: int, span_s: float) -> float:
    """Writer-thread seconds as a share of what `threads` threads had in `span_s` seconds: 1 means
    they stored all they could. At most 1 (a group that stalled longer than the span)."""
    return min(1.0, seconds / (threads * max(span_s, 1e-9)))


class BusyWindow:
    """Writer-thread seconds spent storing groups over the last `window_s` seconds, per second of
    the window (a group's time counts in the second it ended). A gauge of this, not only the
    histogram's counter: with `serve --workers N` the processes share one port and a scrape
    reaches any of them, so a counter's rate mixes processes (each switch looks like a reset and
    inflates it), while a ratio in [0, 1] stays one process's true share."""

    def __init__(self, window_s: int = BUSY_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window = window_s
        self._clock = clock
        self._seconds = [0.0] * window_s
        self._second_of = [-1] * window_s  # which second each slot holds
        self._lock = threading.Lock()  # writer threads add, the scrape reads

    def add(self, seconds: float) -> None:
        now = int(self._clock())
        slot = now % self._window
        with self._lock:
            if self._second_of[slot] != now:
                self._second_of[slot], self._seconds[slot] = now, 0.0
            self._seconds[slot] += seconds

    def total(self) -> float:
        now = int(self._clock())
        with self._lock:
            slots = zip(self._seconds, self._second_of, strict=True)
            return sum(seconds for seconds, at in slots if now - self._window < at <= now)


def refuse(request: Request, reason: str) -> None:
    """Name the reason of the refusal a route is about to raise (where the status alone is ambiguous:
    409 unknown run vs conflicting registration, 422 invalid vs unstorable, 503 busy vs too many large
    bodies at once vs storage)."""
    assert reason in REFUSAL_REASONS, reason
    request.scope.setdefault("state", {})[_REASON_KEY] = reason


class ProcessMetrics(Collector):
    """The per-process families: registered beside the exposition collector (main.py), and
    yielded by a project's scoped view of /metrics too (api/routes/health.py)."""

    def __init__(
        self,
        *,
        queue_records: Callable[[], int] | None = None,
        queue_limit: int | None = None,
        writer_threads: int | None = None,
        journal_acks: Callable[[], int] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._journal_acks = journal_acks  # with an ingest journal only (settings.ingest_journal_dir)
        self._queue_records = queue_records
        self._queue_limit = queue_limit
        self._writer_threads = writer_threads
        self._busy = BusyWindow(clock=clock)
        # A group is one transaction of the batch writer (service/ingest/batch_writer.py). Its seconds
        # summed over a minute, over the writer threads, are how busy they are (the busy ratio): at 1
        # this process stores all it can, and its queue grows if the agents send more.
        self.group_seconds = Histogram(
            "trainvitals_ingest_group_write_duration_seconds",
            "Time a batch-writer thread took to store one group of batches (one transaction, with its "
            "one-by-one retries if the database refused it)",
            buckets=_GROUP_BUCKETS,
            registry=None,
        )
        self.group_batches = Histogram(
            "trainvitals_ingest_group_batches",
            "Batches per group the batch writer stored (the group-commit factor)",
            buckets=_GROUP_SIZES,
            registry=None,
        )
        self.request_seconds = Histogram(
            "trainvitals_http_request_duration_seconds",
            "Time to answer an HTTP request (until the response is sent), per route template",
            ["route", "method"],
            buckets=_BUCKETS,
            registry=None,
        )
        self.requests = Counter(
            "trainvitals_http_requests",
            "HTTP requests answered, per route template and status code",
            ["route", "method", "code"],
            registry=None,
        )
        self.refused = Counter(
            "trainvitals_ingest_refused",
            "Agent requests (POST /v1/batches, /v1/runs) refused, by reason; nothing of them was stored",
            ["reason"],
            registry=None,
        )
        for reason in REFUSAL_REASONS:  # every reason exists from the start: rate() needs a zero
            self.refused.labels(reason)

    def observe(self, *, route: str, method: str, status: int, seconds: float, reason: str | None) -> None:
        self.request_seconds.labels(route, method).observe(seconds)
        self.requests.labels(route, method, str(status)).inc()
        if status >= 400 and (method, route) in INGEST_ROUTES:
            self.refused.labels(reason or _REASON_BY_STATUS.get(status, "other")).inc()

    def observe_group(self, batches: int, seconds: float) -> None:
        """One group written by the batch writer (called on its thread)."""
        self.group_seconds.observe(seconds)
        self.group_batches.observe(batches)
        self._busy.add(seconds)

    def writer_seconds(self) -> float:
        """Seconds the batch-writer threads spent storing groups, since the process started."""
        return next(s.value for f in self.group_seconds.collect() for s in f.samples if s.name.endswith("_sum"))

    @property
    def writer_threads(self) -> int | None:
        return self._writer_threads

    def collect(self) -> Iterator[Metric]:
        metrics: list[Histogram | Counter] = [self.request_seconds, self.requests, self.refused]
        if self._writer_threads is not None:  # a process with a batch writer (main.create_app)
            metrics += [self.group_seconds, self.group_batches]
        for metric in metrics:
            for family in metric.collect():
                yield _without_created(family)
        if self._queue_records is not None:
            yield GaugeMetricFamily(
                "trainvitals_ingest_queue_records",
                "Records accepted by this process and not yet committed (the group-commit writer's queue)",
                value=self._queue_records(),
            )
        if self._queue_limit is not None:
            yield GaugeMetricFamily(
                "trainvitals_ingest_queue_limit_records",
                "Queue size beyond which this process answers 503 busy (settings.max_pending_records)",
                value=self._queue_limit,
            )
        if self._writer_threads is not None:
            yield GaugeMetricFamily(
                "trainvitals_ingest_writer_threads",
                "Batch-writer threads of this process: the most groups it writes at once",
                value=self._writer_threads,
            )
            yield GaugeMetricFamily(
                "trainvitals_ingest_writers_busy_ratio",
                f"Share of the last {BUSY_WINDOW_S} s this process's batch-writer threads spent storing groups "
                "(1: it stores all it can; more traffic grows its write queue)",
                value=busy_share(self._busy.total(), self._writer_threads, BUSY_WINDOW_S),
            )
        if self._journal_acks is not None:
            acks = CounterMetricFamily(
                "trainvitals_ingest_journal_acks",
                "Batches this process acknowledged once in its ingest journal, before their commit",
            )
            acks.add_metric([], self._journal_acks())
            yield acks


def _without_created(family: Metric) -> Metric:
    """The family without prometheus_client's `_created` samples (a timestamp per child, which
    docs/metrics.md does not list). Dropped here rather than by disable_created_metrics(), a
    process-wide switch that would change the exposition of anything else in the process."""
    family.samples = [s for s in family.samples if not s.name.endswith("_created")]
    return family


class RequestMetrics:
    """ASGI middleware timing every HTTP request into `ProcessMetrics`."""

    def __init__(self, app: ASGIApp, *, metrics: ProcessMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # an exception that escapes every handler is answered 500 by the server

        async def send_and_note(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            state = scope.get("state") or {}
            self.metrics.observe(
                route=_route_label(scope),
                method=scope["method"],
                status=status,
                seconds=time.perf_counter() - start,
                reason=state.get(_REASON_KEY),
            )


def _route_label(scope: Scope) -> str:
    """The matched route's template (bounded: never a run id from the path). A request refused
    before routing (413 from BodyLimit) keeps its path when that is an ingest route."""
    template = getattr(scope.get("route"), "path", None)
    if template:
        return str(template)
    return scope["path"] if (scope["method"], scope["path"]) in INGEST_ROUTES else "unmatched"
