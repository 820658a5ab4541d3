"""Advisors over HTTP, and cadence advice from a run's observed saves exported as metrics."""

import pytest
from fastapi.testclient import TestClient

from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings

PLAN = {
    "model": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336, "gated_mlp": True,
              "vocab": 128256, "seq_len": 4096},
    "parallelism": {"gpus": 8, "tp": 1, "pp": 1, "zero": "fsdp", "micro_batch": 1, "global_batch": 64,
                    "recompute": "full"},
    "hardware": {"gpu": "H200", "gpus_per_node": 4},
}


@pytest.fixture
def client(db_url: str):
    with TestClient(create_app(Settings(db=db_url, auth=False, run_analysis=False))) as c:
        yield c


def test_plan_recommend_and_advise(client: TestClient) -> None:
    plan = client.post("/v1/plan", json=PLAN).json()
    assert 0 < plan["mfu"]["low"] <= plan["mfu"]["predicted"] <= plan["mfu"]["high"] < 1
    bad = client.post("/v1/plan", json={**PLAN, "hardware": {"gpu": "Z9000"}})
    assert bad.status_code == 422 and "Z9000" in bad.json()["detail"]
    rec = client.post("/v1/plan/recommend", json=PLAN).json()
    assert rec["feasible"] is True
    advice = client.post("/v1/advise/checkpoints", json={"stall_s": 60, "mtbf_s": 4 * 3600}).json()
    assert round(advice["recommended_interval_s"] / 60) == 21  # sqrt(2 * 60 s * 4 h) ~ 22 min, higher-order
    assert advice["band_s"][0] < advice["recommended_interval_s"] < advice["band_s"][1]
    assert client.post("/v1/advise/checkpoints", json={"stall_s": -1, "mtbf_s": 10}).status_code == 422


def test_run_advice_from_observed_saves_and_failures(client: TestClient) -> None:
    client.post("/v1/runs", json={"run": "r", "tags": {"mtbf_s": "14400"}})
    records = [{"kind": "step", "step": s, "ts": 1000.0 + 10 * s, "step_seconds": 10.0} for s in range(100)]
    records += [{"kind": "checkpoint", "step": s, "generation": s, "status": "persisted", "ts": 1000.0 + 10 * s,
                 "stall_seconds": 30.0, "persist_seconds": 45.0, "bytes": 10**9} for s in (20, 40, 60, 80)]
    client.post("/v1/batches", json={"run": "r", "rank": 0, "incarnation": 1, "seq": 0, "records": records})
    advice = client.get("/v1/runs/r/advice/checkpoints").json()
    assert advice["observed_saves"] == 4
    assert advice["recommended_interval_s"] == pytest.approx(
        client.post("/v1/advise/checkpoints", json={"stall_s": 30, "persist_s": 45, "mtbf_s": 14400,
                                                   "checkpoint_bytes": 1e9}).json()["recommended_interval_s"],
        rel=0.05)
    # The query's numbers are bounded like the body's: a 422 naming the parameter, never a number from inf.
    for query in ("mtbf_s=inf", "mtbf_s=nan", "mtbf_s=0", "restart_s=-1", "detect_s=1e300", "sdc_latency_s=inf"):
        resp = client.get(f"/v1/runs/r/advice/checkpoints?{query}")
        assert resp.status_code == 422 and query.split("=")[0] in resp.text, query
    text = client.get("/metrics").text
    assert 'trainvitals_checkpoint_recommended_interval_seconds{run="r"}' in text
    assert 'trainvitals_checkpoint_interval_band_seconds{bound="low",run="r"}' in text


def test_typed_bodies_refuse_unknown_keys_and_take_tiers(client: TestClient) -> None:
    assert client.post("/v1/plan", json={**PLAN, "extra": 1}).status_code == 422
    assert client.post("/v1/advise/checkpoints", json={"stall_s": 60, "mtbf_s": 3600, "bogus": 1}).status_code == 422
    assert client.post("/v1/advise/checkpoints", json={"stall_s": "60", "mtbf_s": 3600}).status_code == 422
    # The recommender reads gpus (or world_size) and ignores the rest of a plan's layout.
    rec = client.post("/v1/plan/recommend", json={**PLAN, "parallelism": {"world_size": 8, "tp": 4}}).json()
    assert rec["config"]["gpus"] == 8
    tiers = [{"name": "ram", "cost_s": 5, "survives": "node"}, {"name": "pfs", "cost_s": 120, "survives": "cluster"}]
    advice = client.post("/v1/advise/checkpoints", json={"stall_s": 60, "mtbf_s": 14400, "tiers": tiers,
                                                        "radius_mix": {"node": 0.9, "rack": 0.1}}).json()
    assert [t["name"] for t in advice["tiers"]] == ["ram", "pfs"]
    assert advice["tiers"][0]["interval_s"] < advice["tiers"][1]["interval_s"]
    bad = client.post("/v1/advise/checkpoints", json={"stall_s": 60, "mtbf_s": 14400,
                                                     "tiers": [{"name": "x", "cost_s": 1, "survives": "galaxy"}]})
    assert bad.status_code == 422 and "survives" in bad.json()["detail"]


def test_nonsense_gets_a_one_line_422(client: TestClient) -> None:
    for body in ({"stall_s": 1e300, "mtbf_s": 3600}, {"stall_s": 60, "mtbf_s": 1e-300},
                 {"stall_s": 60, "mtbf_s": 3600, "sdc_latency_s": -5}, {"stall_s": 60, "mtbf_s": 0},
                 {"stall_s": 60, "mtbf_s": 3600, "radius_mix": {"galaxy": 1}}):
        r = client.post("/v1/advise/checkpoints", json=body)
        assert r.status_code == 422 and "\n" not in r.json()["detail"], body
    r = client.post("/v1/advise/checkpoints", content=b'{"stall_s": 60, "mtbf_s": Infinity}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422 and "mtbf_s" in r.json()["message"]
    # null is "not given" for every optional key: the default.
    same = client.post("/v1/advise/checkpoints", json={"stall_s": 60, "mtbf_s": 3600, "restart_s": None,
                                                       "sdc_latency_s": None}).json()
    assert same == client.post("/v1/advise/checkpoints", json={"stall_s": 60, "mtbf_s": 3600}).json()
    huge = {**PLAN, "model": {**PLAN["model"], "layers": 10**8}}
    r = client.post("/v1/plan/recommend", json=huge)
    assert r.status_code == 422 and "model.layers" in r.json()["message"] and "10,000" in r.json()["message"]


def test_bodies_over_the_advisor_limit_are_refused(client: TestClient) -> None:
    big = b'{"stall_s": 60, "mtbf_s": 3600, "pad": "' + b"x" * (1024 * 1024) + b'"}'
    assert client.post("/v1/advise/checkpoints", content=big,
                       headers={"content-type": "application/json"}).status_code == 413

    def chunks():  # no Content-Length: the route counts what it reads
        yield big[:1000]
        yield big[1000:]

    assert client.post("/v1/advise/checkpoints", content=chunks(),
                       headers={"content-type": "application/json"}).status_code == 413


def test_advisor_routes_need_a_read_token(db_url: str) -> None:
    from trainvitals.service import auth
    from trainvitals.service.store import db

    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        read = auth.create_token(session, project="p", scope="read")
        ingest = auth.create_token(session, project="p", scope="ingest")
    engine.dispose()
    body = {"stall_s": 60, "mtbf_s": 3600}
    with TestClient(create_app(Settings(db=db_url, run_analysis=False))) as c:
        assert c.post("/v1/advise/checkpoints", json=body).status_code == 401
        assert c.post("/v1/plan", json=PLAN, headers={"Authorization": f"Bearer {ingest}"}).status_code == 403
        ok = c.post("/v1/advise/checkpoints", json=body, headers={"Authorization": f"Bearer {read}"})
        assert ok.status_code == 200 and ok.json()["incidents"] is None
