"""The collector's log lines: key=value with timestamps, tokens scrubbed, access lines at levels
that suit hundreds of batches a second, and the ingest summary over the real counters."""

from __future__ import annotations

import logging
import re

from fastapi.testclient import TestClient

from trainvitals.service.logs import AccessFilter, IngestSummary, KeyValueFormatter, QuietAccessLogger, scrub
from trainvitals.service.main import create_app
from trainvitals.service.self_metrics import ProcessMetrics
from trainvitals.service.settings import Settings
from trainvitals.service.store import analysis_status

TOKEN = "tv_" + "A1b2-C3d4_" * 5  # the shape auth.create_token makes
LINE = re.compile(r"^ts=\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z level=\w+ logger=\S+ pid=\d+ ")


def _record(name: str, msg: str, args: tuple[object, ...] = (), **extra: object) -> logging.LogRecord:
    record = logging.LogRecord(name, logging.INFO, __file__, 1, msg, args, None)
    record.__dict__.update(extra)
    return record


def test_lines_are_key_value_with_a_timestamp() -> None:
    fmt = KeyValueFormatter()
    line = fmt.format(_record("trainvitals.serve", "serve", kv={"listen": "http://127.0.0.1:8000", "x": 0.5}))
    assert LINE.match(line) and line.endswith(" event=serve listen=http://127.0.0.1:8000 x=0.5"), line
    plain = fmt.format(_record("uvicorn.error", 'Started "server" %s', ("x=1",)))
    assert plain.endswith(' msg="Started \\"server\\" x=1"'), plain
    args = ("1.2.3.4:5", "POST", "/v1/x", "1.1", 401)
    access = fmt.format(_record("uvicorn.access", '%s - "%s %s HTTP/%s" %d', args))
    assert access.endswith(" event=http client=1.2.3.4:5 method=POST path=/v1/x http=1.1 status=401"), access


def test_tokens_are_scrubbed_from_every_line() -> None:
    assert TOKEN not in scrub(f"GET /v1/runs?token={TOKEN}&x=1 Authorization: Bearer {TOKEN}")
    assert scrub(f"a {TOKEN} b") == "a tv_*** b"
    assert scrub("Authorization: Bearer abc.def") == "Authorization: Bearer ***"
    assert scrub("/v1/runs?password=hunter2&run=a") == "/v1/runs?password=***&run=a"
    # A test database named tv_test_... is not a token.
    assert scrub("db=postgresql+psycopg://postgres@127.0.0.1:5432/tv_test_0123456789").endswith("tv_test_0123456789")
    line = KeyValueFormatter().format(_record("uvicorn.error", "failed for %s", (f"Bearer {TOKEN}",)))
    assert TOKEN not in line


def test_access_lines_successes_at_debug_refusals_rate_limited_errors_at_warning() -> None:
    def level(f: AccessFilter, status: int) -> tuple[bool, str]:
        record = _record("uvicorn.access", '%s - "%s %s HTTP/%s" %d', ("c", "POST", "/v1/batches", "1.1", status))
        return f.filter(record), record.levelname

    info = AccessFilter("info")
    assert level(info, 200) == (False, "DEBUG")  # hundreds a second: not at info
    assert level(info, 401) == (True, "INFO")
    assert level(info, 401) == (False, "DEBUG")  # the same refusal again within 10 s: counted, not printed
    assert level(info, 403) == (True, "INFO")
    assert level(info, 503) == (True, "WARNING")
    assert level(AccessFilter("debug"), 200) == (True, "DEBUG")
    assert level(AccessFilter("warning"), 401) == (False, "INFO")


def test_a_success_makes_no_access_record_unless_debug_lines_are_on() -> None:
    """QuietAccessLogger, as serve's protocol hands it to Uvicorn: a 200 at info level returns
    before any record is made (the filter never sees it); refusals and errors still reach the
    filter and the handler at their levels, and at debug level so does the 200."""

    def lines(level: str, statuses: list[int]) -> tuple[list[tuple[int, str]], int]:
        logger = logging.Logger("uvicorn.access", logging.DEBUG if level == "debug" else logging.INFO)
        seen: list[logging.LogRecord] = []

        class Counting(AccessFilter):
            def filter(self, record: logging.LogRecord) -> bool:
                seen.append(record)
                return super().filter(record)

        handler = logging.Handler()
        handler.emit = lambda record: out.append((record.args[4], record.levelname))  # type: ignore[index,method-assign]
        logger.addFilter(Counting(level))
        logger.addHandler(handler)
        out: list[tuple[int, str]] = []
        quiet = QuietAccessLogger(logger)
        for status in statuses:
            quiet.info('%s - "%s %s HTTP/%s" %d', "c", "POST", "/v1/batches", "1.1", status)
        return out, len(seen)

    assert lines("info", [200, 200, 204, 401, 500]) == ([(401, "INFO"), (500, "WARNING")], 2)
    assert lines("debug", [200, 401]) == ([(200, "DEBUG"), (401, "INFO")], 2)
    assert lines("warning", [200, 401, 503]) == ([(503, "WARNING")], 2)


def test_ingest_summary_reads_this_process_counters(db_url: str) -> None:
    app = create_app(Settings(db=db_url, auth=False, run_analysis=False))
    clock = iter(range(1000, 2000, 60))
    summary = IngestSummary(app.state.sessionmaker, app.state.process_metrics, interval=60, clock=lambda: next(clock))
    with TestClient(app) as client:
        assert summary.tick() is None  # the baseline
        assert summary.tick() is None  # no traffic: no line
        client.post("/v1/runs", json={"run": "a", "parallelism": {"world_size": 1}})
        for seq in (0, 1, 1):  # the last one is a duplicate
            records = [{"kind": "step", "step": seq * 10 + s, "ts": 1.0, "step_seconds": 0.5} for s in range(10)]
            batch = {"run": "a", "rank": 0, "incarnation": 1, "seq": seq, "records": records}
            assert client.post("/v1/batches", json=batch).status_code == 200
        assert client.post("/v1/batches", json={"run": "a"}).status_code == 422
        assert client.post("/v1/batches", json={"run": "zz", "rank": 0, "incarnation": 1, "seq": 0, "records": []})
        with app.state.sessionmaker() as session:
            analysis_status.record_cycle(session, seconds=0.1, errors=1, now=1100.0, holder="test")
        fields = summary.tick()
    assert fields == {
        "window_s": 60, "batches": 2, "records": 20, "duplicates": 1, "refused": 2, "refused_invalid": 1,
        "refused_unknown_run": 1, "queue_records": 0, "analysis_age_s": 20.0, "analysis_cycles": 1,
        "analysis_errors": 1, "writers_busy": fields["writers_busy"],  # milliseconds of a 60 s window
    }  # fmt: skip
    assert 0 <= fields["writers_busy"] < 0.01


def test_ingest_summary_says_how_busy_the_writers_were(db_url: str) -> None:
    """The share of the window the writer threads spent storing groups: 30 s of writing by 2 threads
    in a 60 s window is a quarter; 1.0 would mean this process stored all it could."""
    app = create_app(Settings(db=db_url, auth=False, run_analysis=False))
    metrics = ProcessMetrics(writer_threads=2)
    clock = iter(range(1000, 2000, 60))
    summary = IngestSummary(app.state.sessionmaker, metrics, interval=60, clock=lambda: next(clock))
    with TestClient(app) as client:
        client.post("/v1/runs", json={"run": "a", "parallelism": {"world_size": 1}})
        assert summary.tick() is None  # the baseline
        record = {"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 0.5}
        batch = {"run": "a", "rank": 0, "incarnation": 1, "seq": 0, "records": [record]}
        assert client.post("/v1/batches", json=batch).status_code == 200
        metrics.observe_group(3, 20.0)
        metrics.observe_group(1, 10.0)
        fields = summary.tick()
    assert fields is not None and fields["writers_busy"] == 0.25
