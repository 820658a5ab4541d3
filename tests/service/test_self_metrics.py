"""The collector's metrics about itself, through the real app: every request is timed per route
template, and every refused agent request is counted once under the reason that refused it."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.service import self_metrics
from trainvitals.service.main import create_app
from trainvitals.service.self_metrics import ProcessMetrics
from trainvitals.service.settings import Settings


@pytest.fixture
def client(db_url: str):
    settings = Settings(db=db_url, max_body_bytes=20_000, run_analysis=False, auth=False)
    with TestClient(create_app(settings)) as c:
        yield c


def _samples(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = client.get("/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _refused(samples: dict, reason: str) -> float:
    return samples[("trainvitals_ingest_refused_total", (("reason", reason),))]


def _batch(run: str, seq: int = 0, **step: object) -> dict:
    record = {"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 1.0, **step}
    return {"run": run, "rank": 0, "incarnation": 1, "seq": seq, "records": [record]}


def test_refusals_are_counted_by_reason_and_requests_timed_per_route(client: TestClient, db_url: str) -> None:
    before = _samples(client)
    assert all(_refused(before, r) == 0 for r in ("invalid", "unknown_run", "too_large", "unstorable", "conflict"))
    assert client.post("/v1/runs", json={"run": "r1"}).status_code == 201
    assert client.post("/v1/batches", json=_batch("r1")).status_code == 200
    assert client.post("/v1/batches", json=_batch("r1", seq=1, step_seconds=-1)).status_code == 422
    assert client.post("/v1/batches", json=_batch("nope")).status_code == 409
    big = b'{"run": "r1", "pad": "' + b"x" * 30_000 + b'"}'
    assert client.post("/v1/batches", content=big, headers={"content-type": "application/json"}).status_code == 413
    # Beyond its 64-bit column: refused by the wire schema, naming the field (invalid, not unstorable).
    refused = client.post("/v1/batches", json=_batch("r1", seq=2, tokens=2**63))
    assert refused.status_code == 422 and "tokens" in refused.text
    assert client.post("/v1/runs", json={"run": "r1", "project": "other"}).status_code == 409
    after = _samples(client)
    reasons = ("invalid", "unknown_run", "too_large", "unstorable", "conflict", "busy", "storage_error")
    assert {r: _refused(after, r) for r in reasons} == {
        "invalid": 2, "unknown_run": 1, "too_large": 1, "unstorable": 0, "conflict": 1, "busy": 0, "storage_error": 0,
    }  # fmt: skip
    # Per route template (never the run id of a path), with the status code.
    for code in ("200", "413"):
        labels = (("code", code), ("method", "POST"), ("route", "/v1/batches"))
        assert after[("trainvitals_http_requests_total", labels)] == 1
    client.get("/v1/runs/r1")
    client.post("/v1/plan", json={})  # its router's prefix included (an included sub-router's was lost: "/plan")
    text = client.get("/metrics").text
    assert 'route="/v1/runs/{run_id}"' in text and 'route="/v1/runs/r1"' not in text
    assert 'code="422",method="POST",route="/v1/plan"' in text
    count = after[("trainvitals_http_request_duration_seconds_count", (("method", "POST"), ("route", "/v1/batches")))]
    assert count == 5  # 200, 422, 409, 413, 422
    assert after[("trainvitals_ingest_queue_records", ())] == 0
    assert after[("trainvitals_ingest_queue_limit_records", ())] > 0
    # The writer's groups: the stored batch and the unknown run's reached it (refused inside the
    # transaction); the 422s and the 413 did not. One thread on SQLite, two on PostgreSQL.
    assert after[("trainvitals_ingest_group_batches_sum", ())] == 2
    groups = after[("trainvitals_ingest_group_batches_count", ())]
    assert groups in (1, 2)
    assert after[("trainvitals_ingest_group_write_duration_seconds_count", ())] == groups
    assert after[("trainvitals_ingest_group_write_duration_seconds_sum", ())] > 0
    assert after[("trainvitals_ingest_writer_threads", ())] == (1 if db_url.startswith("sqlite") else 2)
    assert 0 < after[("trainvitals_ingest_writers_busy_ratio", ())] < 0.01  # milliseconds of writing in a minute


def test_the_list_of_per_process_families_is_what_it_exports() -> None:
    """FAMILIES is how the scale-out check tells per-process families from the shared database's:
    a family missing from it made two replicas' /metrics "differ"."""
    exported = ProcessMetrics(
        queue_records=lambda: 0, queue_limit=1, writer_threads=1, journal_acks=lambda: 3
    ).collect()
    assert sorted(f.name for f in exported) == sorted(self_metrics.FAMILIES)
    # Without an ingest journal there is no journal family (not a counter that stays 0).
    plain = ProcessMetrics(queue_records=lambda: 0, queue_limit=1, writer_threads=1).collect()
    assert sorted(f.name for f in plain) == sorted(set(self_metrics.FAMILIES) - {"trainvitals_ingest_journal_acks"})


def test_the_writers_busy_ratio_is_the_last_minutes_share_of_their_time() -> None:
    """Groups' seconds over the last 60 s, over the writer threads, capped at 1; a group counts in
    the second it ended. A gauge, so that processes sharing a port (`--workers`) do not mix into a
    counter's rate."""
    now = [1000.0]
    metrics = ProcessMetrics(writer_threads=2, clock=lambda: now[0])

    def ratio() -> float:
        return next(f.samples[0].value for f in metrics.collect() if f.name == "trainvitals_ingest_writers_busy_ratio")

    assert ratio() == 0
    metrics.observe_group(3, 20.0)
    now[0] = 1010.5
    metrics.observe_group(1, 10.0)
    assert ratio() == 0.25  # 30 s of 2 threads x 60 s
    now[0] = 1059.9
    assert ratio() == 0.25
    now[0] = 1060.0  # the first group's second (1000) left the window
    assert ratio() == 10.0 / 120
    now[0] = 1071.0
    assert ratio() == 0
    metrics.observe_group(1, 500.0)  # a stall longer than the window
    assert ratio() == 1.0


def test_unauthenticated_agents_are_counted_as_such(db_url: str) -> None:
    with TestClient(create_app(Settings(db=db_url, run_analysis=False, auth=True))) as client:
        assert client.post("/v1/batches", json=_batch("r1")).status_code == 401
        # The operator's scrape of the collector's own families needs a token that is not a project's.
        registry = client.app.state.registry  # type: ignore[attr-defined]
        assert registry.get_sample_value("trainvitals_ingest_refused_total", {"reason": "unauthenticated"}) == 1


def test_the_exposition_is_the_classic_text_format_without_created_series(client: TestClient, promtool_check) -> None:
    """Every Prometheus parses text version 0.0.4; prometheus_client 0.26 answered version=1.0.0
    whatever the scraper accepted. Its `_created` series (undocumented, one per counter and
    histogram child) are not exported."""
    client.post("/v1/runs", json={"run": "r1"})
    for accept in (None, "application/openmetrics-text; version=1.0.0", "text/plain"):
        answer = client.get("/metrics", headers={"Accept": accept} if accept else {})
        assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8", accept
        assert "_created" not in answer.text
        assert "trainvitals_http_requests_total{" in answer.text
        checked = promtool_check(answer.text)
        assert checked.returncode == 0, checked.stdout + checked.stderr
