"""POST /v1/batches answered by its fast path (service/api/ingest_fast_path.py) exactly as through
the framework's routing: the same statuses, bodies, headers and request metrics, for each way a
batch is accepted or refused. The 408 of a body sent too slowly is tested through a real server
(tests/e2e/test_serve_limits.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Receive, Scope, Send

from trainvitals.service import auth
from trainvitals.service.main import CollectorApp, create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db

BATCH = {
    "run": "r1",
    "rank": 0,
    "incarnation": 1,
    "seq": 0,
    "records": [{"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 0.5}],
}


class _Counting:
    """The fast path, counting the requests it answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.requests = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests += 1
        await self.app(scope, receive, send)


@pytest.fixture
def tokens(db_url: str) -> dict[str, str]:
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        out = {scope: auth.create_token(session, project="p", scope=scope) for scope in ("ingest", "read")}
    engine.dispose()
    return out


@pytest.fixture
def clients(db_url: str) -> Iterator[tuple[TestClient, TestClient, _Counting]]:
    """The same collector settings twice, on one database: with the fast path, and without it."""
    settings = Settings(db=db_url, max_body_bytes=20_000, run_analysis=False, settle_seconds=0)
    fast, framework = create_app(settings), create_app(settings)
    assert isinstance(fast, CollectorApp) and fast.ingest_fast_path is not None
    counting = _Counting(fast.ingest_fast_path)
    fast.ingest_fast_path = counting
    framework.ingest_fast_path = None
    with TestClient(fast) as a, TestClient(framework) as b:
        yield a, b, counting


def _requests(tokens: dict[str, str], seq: int) -> list[dict[str, Any]]:
    """One of each answer the route gives; seq keeps the two apps' batches apart."""
    ingest = {"Authorization": f"Bearer {tokens['ingest']}"}
    batch = {**BATCH, "seq": seq}
    bad = {**batch, "records": [{**BATCH["records"][0], "step_seconds": -1}]}  # type: ignore[dict-item]
    return [
        {"json": batch},  # 401: no token
        {"json": batch, "headers": {"Authorization": "Bearer nope"}},  # 401: unknown token
        {"json": batch, "headers": {"Authorization": f"Bearer {tokens['read']}"}},  # 403: a read token
        {"json": {**batch, "run": "unknown"}, "headers": ingest},  # 409: not registered
        {"json": bad, "headers": ingest},  # 422: the field named
        {"content": b"{not json", "headers": {**ingest, "content-type": "application/json"}},  # 422
        {"content": b" " * 30_000, "headers": {**ingest, "content-type": "application/json"}},  # 413
        {"json": batch, "headers": ingest},  # 200: stored
        {"json": batch, "headers": ingest},  # 200: a duplicate
    ]


def _answer(response: Any, seq: int) -> tuple[int, str, dict[str, str]]:
    headers = {k: v for k, v in response.headers.items() if k in ("content-type", "www-authenticate", "retry-after")}
    return response.status_code, response.text.replace(f'"seq":{seq}', '"seq":N'), headers


def _counted(client: TestClient, token: str) -> dict[tuple[str, ...], float]:
    """The batch requests by code, and the refusals by reason, from the app's /metrics."""
    text = client.get("/metrics", headers={"Authorization": f"Bearer {token}"}).text
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "trainvitals_http_requests_total" and s.labels["route"] == "/v1/batches":
                out[("requests", s.labels["method"], s.labels["code"])] = s.value
            elif s.name == "trainvitals_ingest_refused_total":
                out[("refused", s.labels["reason"])] = s.value
    return out


def test_the_fast_path_answers_as_the_framework_does(clients, tokens: dict[str, str]) -> None:
    fast, framework, counting = clients
    registration = {"run": "r1", "parallelism": {"world_size": 1}}
    ingest = {"Authorization": f"Bearer {tokens['ingest']}"}
    assert fast.post("/v1/runs", json=registration, headers=ingest).status_code == 201

    answers = {}
    for name, client, seq in (("fast", fast, 0), ("framework", framework, 1)):
        answers[name] = [_answer(client.post("/v1/batches", **req), seq) for req in _requests(tokens, seq)]
    assert counting.requests == len(_requests(tokens, 0))  # every batch request took the fast path
    assert answers["fast"] == answers["framework"]
    codes = [status for status, _, _ in answers["fast"]]
    assert codes == [401, 401, 403, 409, 422, 422, 413, 200, 200]
    assert "records.0.step.step_seconds: Input should be greater than or equal to 0" in answers["fast"][4][1]
    assert answers["fast"][0][2]["www-authenticate"] == "Bearer"

    # Timed and counted under the route's template with the same codes, refusals under the same reasons.
    counted = _counted(fast, tokens["read"])
    assert counted == _counted(framework, tokens["read"])
    requests = {key[2]: n for key, n in counted.items() if key[0] == "requests"}
    assert requests == {"401": 2, "403": 1, "409": 1, "422": 2, "413": 1, "200": 2}
    assert counted[("refused", "unknown_run")] == 1 and counted[("refused", "invalid")] == 2
