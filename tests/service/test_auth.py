"""Per-project bearer tokens: scopes enforced, project A cannot write or read project B."""

import pytest
from fastapi.testclient import TestClient

from trainvitals.service import auth
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db
from trainvitals.service.store.models import ApiToken


@pytest.fixture
def app_and_tokens(db_url: str):
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        tokens = {(p, s): auth.create_token(session, project=p, scope=s) for p in ("a", "b") for s in auth.SCOPES}
        stored = [t.digest for t in session.query(ApiToken).all()]
    engine.dispose()
    assert all(tok not in stored for tok in tokens.values())  # only digests are stored
    with TestClient(create_app(Settings(db=db_url, run_analysis=False, settle_seconds=0))) as client:
        yield client, tokens


def _h(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


BATCH = {
    "run": "ra",
    "rank": 0,
    "incarnation": 1,
    "seq": 0,
    "records": [{"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 0.5}],
}


def test_scopes_and_projects_are_enforced(app_and_tokens) -> None:
    client, tok = app_and_tokens
    reg = {"run": "ra", "project": "a"}
    assert client.post("/v1/runs", json=reg).status_code == 401
    assert client.post("/v1/runs", json=reg, headers=_h("tv_bogus")).status_code == 401
    assert client.post("/v1/runs", json=reg, headers=_h(tok["a", "read"])).status_code == 403
    assert client.post("/v1/runs", json=reg, headers=_h(tok["b", "ingest"])).status_code == 403
    assert client.post("/v1/runs", json=reg, headers=_h(tok["a", "ingest"])).status_code == 201
    # B's ingest token cannot write into A's run (answered as for a run that does not exist), a
    # read token cannot write at all.
    foreign = client.post("/v1/batches", json=BATCH, headers=_h(tok["b", "ingest"]))
    unknown = client.post("/v1/batches", json={**BATCH, "run": "nope"}, headers=_h(tok["b", "ingest"]))
    assert (foreign.status_code, foreign.json()) == (409, {"detail": "run 'ra' is not registered: POST /v1/runs first"})
    assert (unknown.status_code, unknown.json()["detail"]) == (409, foreign.json()["detail"].replace("'ra'", "'nope'"))
    assert client.post("/v1/batches", json=BATCH, headers=_h(tok["a", "read"])).status_code == 403
    assert client.post("/v1/batches", json=BATCH, headers=_h(tok["a", "ingest"])).json()["accepted"] == 1
    # Reading: A's read token sees A's run; B's does not; an ingest token is not a read token.
    assert client.get("/v1/runs/ra", headers=_h(tok["a", "read"])).json()["step_records"] == 1
    assert client.get("/v1/runs/ra", headers=_h(tok["b", "read"])).status_code == 404  # as if there were none
    assert client.get("/v1/runs/ra/findings", headers=_h(tok["a", "ingest"])).status_code == 403
    assert client.get("/v1/runs", headers=_h(tok["b", "read"])).json() == []
    assert [r["run"] for r in client.get("/v1/runs", headers=_h(tok["a", "read"])).json()] == ["ra"]
    assert client.get("/healthz").status_code == 200


def test_metrics_need_a_read_token_and_show_only_its_project(app_and_tokens) -> None:
    client, tok = app_and_tokens
    for project in ("a", "b"):
        client.post("/v1/runs", json={"run": f"r{project}", "project": project}, headers=_h(tok[project, "ingest"]))
    assert client.get("/metrics").status_code == 401
    text = client.get("/metrics", headers=_h(tok["a", "read"])).text
    assert 'run="ra"' in text and 'run="rb"' not in text
    # The collector's own families name no run or project: a project's scrape gets them too.
    assert 'trainvitals_http_requests_total{code="401",method="GET",route="/metrics"} 1.0' in text
    assert "trainvitals_analysis_cycles_total" in text and "trainvitals_http_request_duration_seconds_bucket" in text
    assert client.get("/metrics", headers=_h(tok["a", "ingest"])).status_code == 403


def test_revoked_token_stops_working(db_url: str) -> None:
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        token = auth.create_token(session, project="a", scope="read")
        verifier = auth.TokenVerifier(cache_seconds=0)
        assert verifier.verify(session, token) == auth.Principal(project="a", scope="read")
        assert auth.revoke_token(session, token=token)
        assert verifier.verify(session, token) is None
    engine.dispose()


def test_run_ids_are_each_projects_own(app_and_tokens) -> None:
    """B registering the run id A uses gets a run of its own: nothing to squat, nothing told about
    A's. Batches, reads, /metrics and deletion each reach the caller's project's run only."""
    client, tok = app_and_tokens
    for project in ("a", "b"):
        reg = client.post("/v1/runs", json={"run": "ra"}, headers=_h(tok[project, "ingest"]))
        assert (reg.status_code, reg.json()["project"]) == (201, project)
    for project, steps in (("a", 3), ("b", 5)):
        for seq in range(steps):
            batch = {**BATCH, "seq": seq, "records": [{**BATCH["records"][0], "step": seq}]}  # type: ignore[dict-item]
            assert client.post("/v1/batches", json=batch, headers=_h(tok[project, "ingest"])).json()["accepted"] == 1
    for project, steps in (("a", 3), ("b", 5)):
        read = _h(tok[project, "read"])
        overview = client.get("/v1/runs/ra", headers=read).json()
        assert (overview["run_id"], overview["project"], overview["step_records"]) == ("ra", project, steps)
        assert [(r["run"], r["project"]) for r in client.get("/v1/runs", headers=read).json()] == [("ra", project)]
        assert 'trainvitals_run_info{project="' + project + '",run="ra",status="running"} 1.0' in client.get(
            "/metrics", headers=read
        ).text
    # Naming the other project is refused, whether or not it has such a run.
    assert client.get("/v1/runs/ra?project=a", headers=_h(tok["b", "read"])).status_code == 403
    assert client.get("/v1/runs/zz?project=a", headers=_h(tok["b", "read"])).status_code == 403
    # B's admin deletes B's run; A's stays whole.
    assert client.delete("/v1/runs/ra", headers=_h(tok["b", "admin"])).status_code == 204
    assert client.get("/v1/runs/ra", headers=_h(tok["b", "read"])).status_code == 404
    assert client.get("/v1/runs/ra", headers=_h(tok["a", "read"])).json()["step_records"] == 3


def test_scope_grants() -> None:
    admin, read, ingest = (auth.Principal(project="a", scope=s) for s in ("admin", "read", "ingest"))
    assert admin.may("admin", "a") and admin.may("read", "a") and not admin.may("ingest", "a")
    assert not admin.may("read", "b")
    assert read.may("read", "a") and not read.may("admin", "a") and not read.may("ingest", "a")
    assert ingest.may("ingest", "a") and not ingest.may("admin", "a") and not ingest.may("read", "a")
    assert auth.ANONYMOUS.may("admin", "any")
