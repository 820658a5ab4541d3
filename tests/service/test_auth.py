"""Per-project bearer tokens: scopes enforced, project A cannot write or read project B."""

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

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


def test_the_token_is_checked_before_a_body_is_read(app_and_tokens) -> None:
    """FastAPI parses a declared body before any dependency: without AuthenticatedFirst anyone made
    the collector parse a registration or an advisor's body (this one, not JSON: 422, not 401)."""
    client, tok = app_and_tokens
    garbage, json_type = b"[" + b"{}," * 200_000, {"content-type": "application/json"}  # not even JSON
    for path in ("/v1/runs", "/v1/plan", "/v1/advise/checkpoints"):
        refused = client.post(path, content=garbage, headers=json_type)
        assert refused.status_code == 401 and refused.json()["detail"] == "missing bearer token", (path, refused.text)
    # With a token the body is read as before: the same garbage is the request model's 422.
    reg = client.post("/v1/runs", content=garbage, headers={**json_type, **_h(tok["a", "ingest"])})
    assert reg.status_code == 422 and reg.json()["message"].startswith("invalid request, nothing stored")


def test_made_up_tokens_cannot_push_real_ones_out_of_the_cache(db_url: str, monkeypatch) -> None:
    """Before, past 10,000 entries the whole cache was cleared, real tokens with the made-up ones:
    a stream of bogus tokens made every agent's batch pay a query again."""
    monkeypatch.setattr(auth.TokenVerifier, "MAX_ENTRIES", 3)
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        real = [auth.create_token(session, project="a", scope="ingest") for _ in range(3)]
        verifier = auth.TokenVerifier(cache_seconds=60)
        for token in real:
            assert verifier.verify(session, token, now=0.0) == auth.Principal(project="a", scope="ingest")
        for i in range(20):
            assert verifier.verify(session, f"tv_made_up_{i}", now=1.0) is None
        assert all(verifier.cached(token, now=2.0) == (True, auth.Principal("a", "ingest")) for token in real)
        # Made-up ones are bounded too, least recently used out first.
        assert verifier.cached("tv_made_up_19", now=2.0) == (True, None)
        assert verifier.cached("tv_made_up_0", now=2.0) == (False, None)
        # A fourth real token pushes out the least recently used real one.
        fourth = auth.create_token(session, project="a", scope="read")
        verifier.cached(real[0], now=3.0)
        assert verifier.verify(session, fourth, now=3.0) == auth.Principal(project="a", scope="read")
        assert verifier.cached(real[1], now=3.0) == (False, None) and verifier.cached(real[0], now=3.0)[0]
    engine.dispose()


def test_a_projects_batch_counter_never_goes_down_and_counts_its_refused_batches(app_and_tokens) -> None:
    """The shipped scrape config uses a project's read token. Deleting a run made that view's
    trainvitals_ingest_batches_total go down (a counter reset: rate() spikes), and a batch refused
    for a run the project has not registered counted in no project's view."""
    client, tok = app_and_tokens

    def batches(project: str) -> dict[str, float]:
        text = client.get("/metrics", headers=_h(tok[project, "read"])).text
        return {
            s.labels["outcome"]: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == "trainvitals_ingest_batches_total"
        }

    assert client.post("/v1/runs", json={"run": "ra"}, headers=_h(tok["a", "ingest"])).status_code == 201
    assert client.post("/v1/batches", json=BATCH, headers=_h(tok["a", "ingest"])).json()["accepted"] == 1
    assert client.post("/v1/batches", json=BATCH, headers=_h(tok["a", "ingest"])).json()["duplicate"] is True
    assert client.post("/v1/batches", json={**BATCH, "run": "ghost"}, headers=_h(tok["a", "ingest"])).status_code == 409
    before = batches("a")
    assert before == {"stored": 1, "duplicate": 1, "rejected": 1}
    assert client.delete("/v1/runs/ra", headers=_h(tok["a", "admin"])).status_code == 204
    assert batches("a") == before
    assert batches("b") == {"stored": 0, "duplicate": 0, "rejected": 0}  # none of A's in B's view
