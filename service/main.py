"""The collector application: `create_app(settings)` wires store, routes and exposition."""

from __future__ import annotations

from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from trainvitals.service.analysis import expectations
from trainvitals.service.analysis.worker import AnalysisWorker
from trainvitals.service.api.ingest_fast_path import IngestEndpoint, is_ingest
from trainvitals.service.api.routes import advisors, health, ingest, runs
from trainvitals.service.auth import TokenVerifier
from trainvitals.service.exposition import TrainvitalsCollector, make_registry
from trainvitals.service.gc_policy import serving_gc
from trainvitals.service.http_limits import HEADER_TIMEOUT_KEY, BodyDeadline, BodyLimit
from trainvitals.service.ingest.batch_writer import BatchWriter
from trainvitals.service.ingest.journal import IngestJournal
from trainvitals.service.ingest.journal_replay import replay_journal
from trainvitals.service.logs import IngestSummary
from trainvitals.service.self_metrics import ProcessMetrics, RequestMetrics
from trainvitals.service.settings import Settings
from trainvitals.service.store import db
from trainvitals.service.store.lease import AnalysisLease
from trainvitals.wire import WIRE_VERSION


class CollectorApp(FastAPI):
    """The FastAPI app, but POST /v1/batches goes to its fast path (api/ingest_fast_path.py)."""

    ingest_fast_path: ASGIApp | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.ingest_fast_path is not None and is_ingest(scope):
            scope["app"] = self
            await self.ingest_fast_path(scope, receive, send)
        else:
            await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> CollectorApp:
    settings = settings or Settings()
    db.prepare(settings.db, migrate=settings.migrate_on_start)
    engine = db.make_engine(settings.db, application_name=db.SERVE_APPLICATION_NAME)
    sessions = db.make_sessionmaker(engine)
    worker = AnalysisWorker(sessions, settings, lease=AnalysisLease(engine))
    process_metrics = ProcessMetrics(
        queue_records=lambda: writer.pending_records,
        queue_limit=settings.max_pending_records,
        writer_threads=settings.ingest_writer_thread_count,
        journal_acks=(lambda: writer.journal_acks) if settings.ingest_journal_dir else None,
    )
    journal = IngestJournal.open(settings.ingest_journal_dir) if settings.ingest_journal_dir else None
    writer = BatchWriter(
        sessions,
        threads=settings.ingest_writer_thread_count,
        max_pending_records=settings.max_pending_records,
        synchronous_commit=settings.ingest_synchronous_commit,
        group_wait_s=settings.ingest_group_wait_s,
        observe_group=process_metrics.observe_group,
        journal=journal,
        journal_ack_records=settings.ingest_journal_ack_records,
    )
    checkpointer = db.WalCheckpointer(engine)
    summary = IngestSummary(
        sessions, process_metrics, interval=settings.log_summary_seconds, queue_records=lambda: writer.pending_records
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        # /healthz pings the database on a thread of its own: it answers while every worker thread
        # is busy (large bodies decoding, slow reads), so a liveness probe does not kill a busy collector.
        app.state.health_executor = health_executor = ThreadPoolExecutor(1, thread_name_prefix="trainvitals-healthz")
        if settings.analysis_interval_seconds > 0 and settings.run_analysis:
            worker.start()
        writer.start()
        if journal is not None:  # before the first request: what earlier processes acknowledged, maybe not stored
            await replay_journal(journal, writer, ingest.decode_body)
        checkpointer.start()
        summary.start()
        with serving_gc():  # the start-up heap frozen, fewer young collections (service/gc_policy.py)
            yield {HEADER_TIMEOUT_KEY: settings.header_timeout_seconds}  # for serve's protocol (http_limits.py)
        summary.stop()
        writer.stop()  # writes what was already accepted before the process exits
        if journal is not None:
            journal.close()
        worker.stop()
        checkpointer.stop()
        health_executor.shutdown(wait=False)
        engine.dispose()

    # The API's map only when asked for (--api-docs): it is not handed to whoever reaches the port.
    docs = settings.api_docs
    app = CollectorApp(
        title="trainvitals collector",
        version=f"wire-v{WIRE_VERSION}",
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.settings = settings
    app.state.engine = engine
    app.state.sessionmaker = sessions
    app.state.worker = worker
    app.state.batch_writer = writer
    app.state.large_bodies = 0  # large ingest bodies being read now (routes/ingest.py _LargeBody)
    app.state.verifier = TokenVerifier(settings.token_cache_seconds)
    app.state.collector = TrainvitalsCollector(
        sessions,
        settings,
        mfu_expectation=expectations.mfu_expectation,
        checkpoint_advice=expectations.checkpoint_advice,
    )
    app.state.process_metrics = process_metrics
    app.state.registry = make_registry(app.state.collector)
    app.state.registry.register(app.state.process_metrics)
    app.include_router(ingest.router)
    app.include_router(runs.router)
    app.include_router(advisors.router)
    app.include_router(health.router)
    app.exception_handler(RequestValidationError)(_validation_error)

    # Innermost first. The same stack around the ingest route's fast path as around the app.
    middleware: list[tuple[Any, dict[str, Any]]] = [
        (BodyDeadline, {"seconds": settings.body_timeout_seconds}),
        (BodyLimit, {"max_bytes": settings.max_body_bytes}),
        (RequestMetrics, {"metrics": app.state.process_metrics}),  # outermost: sees BodyLimit's 413
    ]
    fast_path: ASGIApp = IngestEndpoint(app, ingest.router)
    for cls, options in middleware:
        app.add_middleware(cls, **options)
        fast_path = cls(fast_path, **options)
    app.ingest_fast_path = fast_path
    return app


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    """422 whose message names every offending field by its path, e.g. records.3.step.loss."""
    errors = exc.errors()
    problems = []
    for err in errors:
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        problems.append(f"{'.'.join(loc) or '<body>'}: {err.get('msg')}")
    message = "invalid request, nothing stored: " + "; ".join(problems[:10])
    if len(problems) > 10:
        message += f"; and {len(problems) - 10} more"
    detail = [{k: v for k, v in e.items() if k in ("loc", "msg", "type")} for e in errors[:100]]
    return JSONResponse({"message": message, "detail": detail}, status_code=422)
