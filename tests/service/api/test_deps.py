"""Run authorisation as a dependency: every route under /v1/runs/{run_id} answers 401 without a
token, 404 for an unknown run and for another project's (the same answer: nothing tells a project
which run ids another one uses), 403 for the wrong scope in the token's own project."""

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
        missing = client.get(unknown, headers=h["a", "read"])
        assert missing.status_code == 404, route
        # Another project's run: word for word the answer for a run that does not exist.
        foreign = client.get(route.format(run="nope").replace("nope", "ra"), headers=h["b", "read"])
        assert (foreign.status_code, foreign.json()) == (404, {"detail": "no run 'ra'"}), route
        assert missing.json() == {"detail": "no run 'nope'"}, route
        assert client.get(own, headers=h["a", "ingest"]).status_code == 403, route
        # Authorised (a read token, or an admin's, which reads too): the route's own answer (the
        # advice has no saves to go on yet: its 422; the run has no tensor w: the timeline's 404).
        for token in (h["a", "read"], h["a", "admin"]):
            answer = client.get(own, headers=token)
            if "/tensors/w/" in route:
                assert (answer.status_code, answer.json()["detail"][:27]) == (404, "run 'ra' has no tensor 'w' ")
            else:
                assert answer.status_code in (200, 422), route
    assert client.get("/v1/runs/ra/advice/checkpoints", headers=h["a", "read"]).status_code == 422


def test_listing_and_deleting(client_and_tokens) -> None:
    client, h = client_and_tokens
    assert client.get("/v1/runs?project=b", headers=h["a", "read"]).status_code == 403
    assert [r["run"] for r in client.get("/v1/runs?project=a", headers=h["a", "read"]).json()] == ["ra"]
    # Deleting needs the admin scope: neither the agents' ingest token nor a dashboard's read token.
    for scope in ("read", "ingest"):
        refused = client.delete("/v1/runs/ra", headers=h["a", scope])
        assert refused.status_code == 403 and "this needs scope 'admin'" in refused.json()["detail"], scope
    assert client.delete("/v1/runs/ra", headers=h["b", "admin"]).json() == {"detail": "no run 'ra'"}
    assert client.delete("/v1/runs/nope", headers=h["a", "admin"]).status_code == 404
    assert client.get("/v1/runs/ra", headers=h["a", "read"]).status_code == 200  # nothing deleted yet
    assert client.delete("/v1/runs/ra", headers=h["a", "admin"]).status_code == 204
    assert client.get("/v1/runs/ra", headers=h["a", "read"]).status_code == 404


def test_an_admin_token_cannot_ingest(client_and_tokens) -> None:
    """admin reads and deletes; writing stays the agents' ingest tokens' (an admin token never
    has to be handed to a job)."""
    client, h = client_and_tokens
    batch = {"run": "ra", "rank": 0, "incarnation": 1, "seq": 0, "records": []}
    assert client.post("/v1/batches", json=batch, headers=h["a", "admin"]).status_code == 403
    assert client.post("/v1/runs", json={"run": "rx", "project": "a"}, headers=h["a", "admin"]).status_code == 403
