"""Run authorisation as a dependency: every route under /v1/runs/{run_id} answers 401 without a
token, 404 for an unknown run, 403 for another project's run or the wrong scope."""

import pytest
from fastapi.testclient import TestClient

from trainvitals.service import auth
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db

READ_ROUTES = [
    "/v1/runs/{run}",
    "/v1/runs/{run}/findings",
    "/v1/runs/{run}/analysis",
    "/v1/runs/{run}/checkpoints",
    "/v1/runs/{run}/rollback",
    "/v1/runs/{run}/tensors/worst",
    "/v1/runs/{run}/tensors/w/timeline",
    "/v1/runs/{run}/ranks/step-times?start=0&end=1",
    "/v1/runs/{run}/advice/checkpoints?mtbf_s=3600",
]


@pytest.fixture
def client_and_tokens(db_url: str):
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        tokens = {(p, s): auth.create_token(session, project=p, scope=s) for p in ("a", "b") for s in auth.SCOPES}
    engine.dispose()
    with TestClient(create_app(Settings(db=db_url, run_analysis=False, settle_seconds=0))) as client:
        h = {"Authorization": f"Bearer {tokens['a', 'ingest']}"}
        assert client.post("/v1/runs", json={"run": "ra", "project": "a"}, headers=h).status_code == 201
        yield client, {k: {"Authorization": f"Bearer {t}"} for k, t in tokens.items()}


def test_read_routes_authorise_the_run(client_and_tokens) -> None:
    client, h = client_and_tokens
    for route in READ_ROUTES:
        own, unknown = route.format(run="ra"), route.format(run="nope")
        assert client.get(own).status_code == 401, route
        assert client.get(unknown, headers=h["a", "read"]).status_code == 404, route
        assert client.get(own, headers=h["b", "read"]).status_code == 403, route
        assert client.get(own, headers=h["a", "ingest"]).status_code == 403, route
        # Authorised: the route's own answer (the advice has no saves to go on yet: its 422).
        assert client.get(own, headers=h["a", "read"]).status_code in (200, 422), route
    assert client.get("/v1/runs/ra/advice/checkpoints", headers=h["a", "read"]).status_code == 422


def test_listing_and_deleting(client_and_tokens) -> None:
    client, h = client_and_tokens
    assert client.get("/v1/runs?project=b", headers=h["a", "read"]).status_code == 403
    assert [r["run"] for r in client.get("/v1/runs?project=a", headers=h["a", "read"]).json()] == ["ra"]
    assert client.delete("/v1/runs/ra", headers=h["a", "read"]).status_code == 403  # deleting is a write
    assert client.delete("/v1/runs/ra", headers=h["b", "ingest"]).status_code == 403
    assert client.delete("/v1/runs/nope", headers=h["a", "ingest"]).status_code == 404
    assert client.delete("/v1/runs/ra", headers=h["a", "ingest"]).status_code == 204
    assert client.get("/v1/runs/ra", headers=h["a", "read"]).status_code == 404
