"""The collector's logs: one `key=value` line per event with a UTC timestamp, Uvicorn's access log
at a level that suits hundreds of batches a second, tokens scrubbed from every line, and the
periodic ingest summary.

A line looks like::

    ts=2025-05-01T12:00:00.123Z level=info logger=trainvitals.serve pid=4242 event=serve listen=...

Access lines: a successful request is logged at debug level (`--log-level debug` shows every
batch); a refused one (4xx) at info, at most one per status code per 10 s (the ingest summary
counts every refusal by reason); a 5xx at warning. Libraries other than trainvitals and Uvicorn
log at warning and above only (SQLAlchemy would otherwise print every statement at debug).
"""

from __future__ import annotations

import logging
import logging.config
import os
import re
import socket
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session

from trainvitals.service.periodic import Periodic
from trainvitals.service.self_metrics import ProcessMetrics, busy_share

LEVELS = ("debug", "info", "warning", "error")
_REFUSAL_LINE_SECONDS = 10.0
_FIRST_REFUSAL_STATUS = 400
"""An access line below this status is a debug line (AccessFilter), so QuietAccessLogger skips it."""

# Tokens are tv_ + 43 URL-safe characters (auth.create_token); a client may also put a secret in
# a query string or a log message may quote a header. Scrubbed from the formatted line, so no
# handler, traceback or third-party message can let one through.
_SECRETS = (
    (re.compile(r"tv_[A-Za-z0-9_-]{40,}"), "tv_***"),
    (re.compile(r"(?i)(bearer\s+)[^\s\"',]+"), r"\1***"),
    (re.compile(r"(?i)((?:token|password|passwd|secret|api[_-]?key)=)[^&\s\"']+"), r"\1***"),
)


def scrub(text: str) -> str:
    for pattern, replacement in _SECRETS:
        text = pattern.sub(replacement, text)
    return text


def log_event(logger: logging.Logger, event: str, *, level: int = logging.INFO, **fields: Any) -> None:
    """Log `event=NAME key=value ...` (fields rendered by KeyValueFormatter; None values left out)."""
    logger.log(level, event, extra={"kv": {k: v for k, v in fields.items() if v is not None}})


def _value(v: Any) -> str:
    if isinstance(v, float):
        v = f"{v:.6g}"
    s = str(v)
    if s and not re.search(r"[\s\"=\\]", s):
        return s
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


class KeyValueFormatter(logging.Formatter):
    """`ts=... level=... logger=... pid=...` then the event's fields, or msg="..." for plain messages."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        fields: dict[str, Any] = {"ts": ts, "level": record.levelname.lower(), "logger": record.name}
        fields["pid"] = record.process
        kv = getattr(record, "kv", None)
        if isinstance(kv, Mapping):
            fields["event"] = record.getMessage()
            fields.update(kv)
        elif record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            client, method, path, http, status = record.args
            fields.update(event="http", client=client, method=method, path=path, http=http, status=status)
        else:
            fields["msg"] = record.getMessage()
        line = " ".join(f"{k}={_value(v)}" for k, v in fields.items())
        if record.exc_info:  # the traceback on the lines below, as Python prints it
            line += "\n" + self.formatException(record.exc_info)
        return scrub(line)


class AccessFilter(logging.Filter):
    """Sets each Uvicorn access line's level from its status and drops it below the threshold."""

    def __init__(self, threshold: str = "info") -> None:
        super().__init__()
        self.threshold = logging.getLevelName(threshold.upper())
        self._last_refusal: dict[int, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        status = record.args[4] if isinstance(record.args, tuple) and len(record.args) == 5 else 0
        level = logging.DEBUG
        if isinstance(status, int) and status >= 500:
            level = logging.WARNING
        elif isinstance(status, int) and status >= _FIRST_REFUSAL_STATUS:
            # An agent with a wrong token retries every few seconds from every rank: one line per
            # status per window says what is happening; the rest are counted in the summary.
            now = time.monotonic()
            if now - self._last_refusal.get(status, -1e9) >= _REFUSAL_LINE_SECONDS:
                self._last_refusal[status] = now
                level = logging.INFO
        record.levelno, record.levelname = level, logging.getLevelName(level)
        return level >= self.threshold


class QuietAccessLogger:
    """Uvicorn's access logger as its HTTP protocol calls it (`info(format, client, method, path,
    http_version, status)`), returning at once for a request answered below 400 unless debug lines
    are on: AccessFilter would drop that line anyway, but only after Logger.info had found its
    caller's frame and made its record, 2% of the event loop's GIL time at a thousand batches a
    second (docs/performance.md, session 62). Every other line goes to the logger as before."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger

    def info(self, msg: str, *args: Any) -> None:
        status = args[4] if len(args) == 5 else None
        if isinstance(status, int) and status < _FIRST_REFUSAL_STATUS and not self.logger.isEnabledFor(logging.DEBUG):
            return
        self.logger.info(msg, *args)


def log_config(level: str = "info") -> dict[str, Any]:
    """The logging.config dict for the collector's processes (also handed to Uvicorn, which applies
    it again in each process of `serve --workers`)."""
    upper = level.upper()
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"kv": {"()": KeyValueFormatter}},
        "filters": {"access": {"()": AccessFilter, "threshold": level}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "kv"}},
        "root": {"level": "WARNING", "handlers": ["stderr"]},
        "loggers": {
            "trainvitals": {"level": upper},
            "uvicorn": {"level": upper, "handlers": [], "propagate": True},
            "uvicorn.error": {"level": upper},
            # Records are made at info (debug: every request) so that the filter can raise a 5xx.
            "uvicorn.access": {"level": "DEBUG" if upper == "DEBUG" else "INFO", "filters": ["access"]},
        },
    }


def configure(level: str = "info") -> None:
    logging.config.dictConfig(log_config(level))


class IngestSummary:
    """One `event=ingest_summary` line every `interval` seconds while this process takes traffic.

    Nothing is counted twice: batches and records come from the database's ingest_counts rows of
    this process's writer threads (named "host:pid:i" by BatchWriter), refusals by reason and the
    writers' busy seconds from ProcessMetrics (what /metrics exports), the analysis age and errors
    from the analysis_status row (whichever process analyses). A window without batches or
    refusals logs nothing. Usage::

        summary = IngestSummary(sessionmaker, app.state.process_metrics, interval=60.0)
        summary.start()
        ...
        summary.stop()
    """

    def __init__(
        self,
        sessions: Callable[[], Session],
        metrics: ProcessMetrics,
        *,
        interval: float,
        queue_records: Callable[[], int] = lambda: 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sessions = sessions
        self._metrics = metrics
        self._interval = interval
        self._queue_records = queue_records
        self._clock = clock
        self._previous: dict[str, Any] | None = None
        # The first tick, at once, only sets the baseline the first window is counted from.
        self._thread = Periodic("trainvitals-ingest-summary", interval, self._log_window, first_now=True)
        self.log = logging.getLogger("trainvitals.serve")

    def start(self) -> None:
        if self._interval > 0:
            self._thread.start()

    def stop(self) -> None:
        self._thread.stop()

    def tick(self) -> dict[str, Any] | None:
        """Read the counters; the fields of a summary line when the window since the previous
        tick had traffic, else None (the first tick only sets the baseline)."""
        now = self._read()
        before, self._previous = self._previous, now
        if before is None:
            return None
        batches = now["stored"][0] - before["stored"][0]
        duplicates = now["duplicate"][0] - before["duplicate"][0]
        refused = {r: int(n - before["refused"].get(r, 0)) for r, n in now["refused"].items()}
        refused = {r: n for r, n in refused.items() if n}
        if not (batches or duplicates or refused):
            return None
        fields: dict[str, Any] = {
            "window_s": round(now["at"] - before["at"]),
            "batches": batches,
            "records": now["stored"][1] - before["stored"][1],
            "duplicates": duplicates,
            "refused": sum(refused.values()),
            **{f"refused_{reason}": n for reason, n in sorted(refused.items())},
            "queue_records": self._queue_records(),
        }
        threads = self._metrics.writer_threads
        if threads:  # 1.0: the writers stored all this process could, and a growing queue says it fell behind
            busy = busy_share(now["writer_seconds"] - before["writer_seconds"], threads, now["at"] - before["at"])
            fields["writers_busy"] = round(busy, 2)
        if now["analysis_at"] is None:
            fields["analysis"] = "never"  # no cycle has finished on this database yet
        else:
            fields["analysis_age_s"] = round(now["at"] - now["analysis_at"], 1)
            fields["analysis_cycles"] = now["analysis_cycles"] - (before["analysis_cycles"] or 0)
            fields["analysis_errors"] = now["analysis_errors"] - (before["analysis_errors"] or 0)
        return fields

    def _read(self) -> dict[str, Any]:
        from trainvitals.service.store import analysis_status, queries

        # The writers' names as BatchWriter.start() makes them (host:pid:thread).
        prefix = f"{socket.gethostname()}:{os.getpid()}:"
        with self._sessions() as session:
            totals = queries.ingest_totals(session, writer_prefix=prefix)
            status = analysis_status.read(session)
        refused = {
            s.labels["reason"]: s.value
            for family in self._metrics.refused.collect()
            for s in family.samples
            if s.name.endswith("_total")
        }
        return {
            "at": self._clock(),
            "stored": totals.get("stored", (0, 0)),
            "duplicate": totals.get("duplicate", (0, 0)),
            "refused": refused,
            "writer_seconds": self._metrics.writer_seconds(),
            "analysis_at": status.last_cycle_at if status else None,
            "analysis_cycles": status.cycles if status else 0,
            "analysis_errors": status.errors if status else 0,
        }

    def _log_window(self) -> None:
        try:
            if (fields := self.tick()) is not None:
                log_event(self.log, "ingest_summary", **fields)
        except Exception:  # noqa: BLE001 - a database hiccup: say so, try again next window
            self.log.warning("ingest summary failed", exc_info=True)
