"""The collector's HTTP surface, through the real app (FastAPI TestClient), on both backends."""

import json

import pytest
from fastapi.testclient import TestClient

from trainvitals.service.api import schemas
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings


@pytest.fixture
def client(db_url: str):
    with TestClient(
        create_app(
            Settings(db=db_url, max_body_bytes=200_000, run_analysis=False, auth=False, settle_seconds=0, api_docs=True)
        )
    ) as c:
        yield c


def _batch(seq: int = 0, steps: range = range(3), rank: int = 0) -> dict:
    return {
        "run": "r1",
        "rank": rank,
        "incarnation": 1,
        "seq": seq,
        "records": [{"kind": "step", "step": s, "ts": 1.0, "step_seconds": 0.25, "loss": 3.0} for s in steps],
    }


def test_register_ingest_retry_and_read_back(client: TestClient) -> None:
    assert client.post("/v1/runs", json={"run": "r1", "parallelism": {"world_size": 1}}).status_code == 201
    assert client.post("/v1/runs", json={"run": "r1"}).status_code == 200
    assert client.post("/v1/batches", json=_batch()).json() == {"accepted": 3, "duplicate": False}
    assert client.post("/v1/batches", json=_batch()).json() == {"accepted": 0, "duplicate": True}
    overview = client.get("/v1/runs/r1").json()
    assert overview["step_records"] == 3 and overview["ranks"] == 1
    assert [r["run"] for r in client.get("/v1/runs").json()] == ["r1"]


def test_a_run_id_reused_by_another_job_is_refused_and_a_relaunch_is_not(client: TestClient) -> None:
    job = {"run": "r1", "incarnation": 1, "model": {"hidden": 768}, "parallelism": {"world_size": 1}}
    assert client.post("/v1/runs", json=job).status_code == 201
    client.post("/v1/batches", json=_batch(steps=range(5)))
    # The same script launched again (same model, same size): a restart, a new incarnation.
    assert client.post("/v1/runs", json={**job, "incarnation": 2}).status_code == 200
    assert client.post("/v1/batches", json={**_batch(steps=range(3)), "incarnation": 2}).json()["accepted"] == 3
    # Another script on the same host derives the same default run id: refused, and so are its batches.
    other = {**job, "incarnation": 3, "model": {"hidden": 256}, "parallelism": {"world_size": 2}}
    resp = client.post("/v1/runs", json=other)
    assert resp.status_code == 409
    assert resp.json()["detail"].startswith(
        "run 'r1' is registered for another job (model.hidden: 768 registered, 256 now; "
        "parallelism.world_size: 1 registered, 2 now): nothing of this process is stored under it. Give this "
        "job its own run id"
    )
    refused = client.post("/v1/batches", json={**_batch(steps=range(50)), "incarnation": 3})
    assert refused.status_code == 409 and refused.json()["detail"] == resp.json()["detail"]
    overview = client.get("/v1/runs/r1").json()
    assert (overview["step_records"], overview["last_step"]) == (8, 4)  # nothing of the other job
    # Declared a resume (an elastic resize, a new layout): accepted, and its batches with it.
    assert client.post("/v1/runs", json={**other, "resume": True}).status_code == 200
    assert client.post("/v1/batches", json={**_batch(steps=range(2)), "incarnation": 3}).json()["accepted"] == 2


def test_short_run_overview_says_when_detection_starts(client: TestClient) -> None:
    """A run shorter than the detectors' warm-up is not silently 'healthy': its overview says from
    which step it is judged and how far off that is; a registered warm-up is the one it is told."""
    client.post("/v1/runs", json={"run": "r1"})
    client.post("/v1/batches", json=_batch(steps=range(100)))
    ov = client.get("/v1/runs/r1").json()
    starts = (ov["detector_warmup_steps"], ov["detection_starts_at_step"], ov["warmup_steps_remaining"])
    assert starts == (300, 300, 201)
    assert ov["detection"] == (
        "detection starts at step 300, 201 steps from now (warm-up: 300 steps from step 0); until then only "
        "non-finite values, failed checkpoints and stalls are reported"
    )
    stop = {"kind": "event", "ts": 2.0, "event": "stop"}
    client.post("/v1/batches", json={**_batch(seq=1, steps=range(0)), "records": [stop]})  # rank 0 closed
    assert (
        client.get("/v1/runs/r1")
        .json()["detection"]
        .startswith("the run ended at step 99, before detection would have started at step 300")
    )
    client.post("/v1/runs", json={"run": "r2", "detector_warmup_steps": 50})
    client.post("/v1/batches", json={**_batch(steps=range(100)), "run": "r2"})
    ov = client.get("/v1/runs/r2").json()
    assert (ov["detection_starts_at_step"], ov["warmup_steps_remaining"]) == (50, 0)
    assert ov["detection"] == "detecting since step 50 (warm-up: 50 steps from step 0)"
    client.post("/v1/runs", json={"run": "r3"})
    assert client.get("/v1/runs/r3").json()["detection"].startswith("no steps yet: detection starts 300 steps")


def test_run_overview_says_the_mfu_or_what_is_missing_for_one(client: TestClient) -> None:
    """MFU needs a device peak (declared, or the GPU table's) and FLOPs per step; the overview
    names the first one missing and what to declare."""
    dims = {"non_embedding_params": 1000, "layers": 2, "hidden": 16, "seq_len": 8}
    cases = {
        "measured": ({"hardware": {"gpu_count": 1, "peak_flops": 1e6}}, {"flops": 1e5, "tokens": 8}),
        "cpu": ({"hardware": {"gpu_type": "cpu"}}, {"flops": 1e5}),
        "unknown-gpu": ({"hardware": {"gpu_type": "T4", "gpu_count": 1}}, {"flops": 1e5}),
        "no-peak": ({}, {"flops": 1e5}),
        "no-flops": ({"hardware": {"gpu_type": "H100-SXM"}, "model": {"layers": 2}}, {"tokens": 8}),
        "nothing": ({"hardware": {"gpu_type": "H100-SXM"}, "model": dims}, {}),
    }
    for run, (registration, step) in cases.items():
        client.post("/v1/runs", json={"run": run, **registration})
        records = [{"kind": "step", "step": s, "ts": 1.0, "step_seconds": 0.5, **step} for s in range(3)]
        client.post("/v1/batches", json={"run": run, "rank": 0, "incarnation": 1, "seq": 0, "records": records})
    client.app.state.worker.run_once()  # type: ignore[attr-defined]  # reduce (the analysis is off here)
    mfu = {run: client.get(f"/v1/runs/{run}").json()["mfu"] for run in cases}
    assert mfu == {
        "measured": "MFU 20.0% over the newest 3 reduced steps",  # 1e5 FLOPs / (0.5 s x 1e6 FLOP/s)
        "cpu": "no MFU: the run is on CPU; declare hardware.peak_flops (dense FLOP/s per device) to get one",
        "unknown-gpu": "no MFU: GPU 'T4' is not in the hardware table; declare hardware.peak_flops (dense FLOP/s)",
        "no-peak": "no MFU: the device's peak is unknown; declare hardware.gpu_type or hardware.peak_flops",
        "no-flops": "no MFU: no FLOPs per step (the registration lacks model.non_embedding_params, model.hidden, "
        "model.seq_len); declare them in registration={'model': ...} or pass step(flops=...)",
        "nothing": "no MFU: the steps carry neither FLOPs nor tokens; pass step(tokens=...) or step(flops=...)",
    }


def test_malformed_batch_is_rejected_whole_with_the_field_named(client: TestClient) -> None:
    client.post("/v1/runs", json={"run": "r1"})
    body = _batch(steps=range(5))
    body["records"][3]["step_seconds"] = "slow"
    resp = client.post("/v1/batches", json=body)
    assert resp.status_code == 422
    assert "records.3.step.step_seconds" in resp.json()["message"]
    assert client.get("/v1/runs/r1").json()["step_records"] == 0  # nothing of the batch stored
    # The collector keeps serving, and the same seq can still be delivered correctly.
    assert client.post("/v1/batches", json=_batch(steps=range(5))).json()["accepted"] == 5
    assert client.get("/healthz").json() == {"status": "ok"}


def test_a_value_no_database_column_holds_is_a_422_naming_the_field(client: TestClient) -> None:
    """A value outside its column's range is refused by the wire schema itself (a 422 naming the
    field, never stored wrapped or retried forever), and the whole batch is refused."""
    client.post("/v1/runs", json={"run": "r1"})
    body = _batch(steps=range(4))
    body["records"][2]["tokens"] = 2**70
    resp = client.post("/v1/batches", json=body)
    assert resp.status_code == 422 and "tokens" in json.dumps(resp.json()["detail"])
    assert client.get("/v1/runs/r1").json()["step_records"] == 0
    assert client.post("/v1/batches", json=_batch(steps=range(4))).json()["accepted"] == 4


def test_unknown_run_and_oversized_body(client: TestClient) -> None:
    resp = client.post("/v1/batches", json=_batch())
    assert resp.status_code == 409 and "not registered" in resp.json()["detail"]
    client.post("/v1/runs", json={"run": "r1"})
    big = _batch(steps=range(4000))
    resp = client.post("/v1/batches", content=json.dumps(big), headers={"content-type": "application/json"})
    assert resp.status_code == 413 and "exceeds" in resp.json()["detail"]


def test_routes_but_the_batch_route_take_bodies_of_1_mib(db_url: str) -> None:
    """Before, a registration was read up to the batch limit (32 MB by default), and a chunked one
    without any limit: it was parsed whole, before the token was checked."""
    settings = Settings(db=db_url, run_analysis=False, auth=False, settle_seconds=0)
    assert settings.max_body_bytes == 32 << 20
    with TestClient(create_app(settings)) as client:
        _only_small_bodies_but_batches(client)


JSON = {"content-type": "application/json"}


def _only_small_bodies_but_batches(client: TestClient) -> None:
    pad = b'{"run": "r1", "tags": {"pad": "' + b"x" * (1 << 20) + b'"}}'

    def chunks():  # no Content-Length: counted as it arrives
        for i in range(0, len(pad), 65536):
            yield pad[i : i + 65536]

    for content in (pad, chunks()):
        resp = client.post("/v1/runs", content=content, headers=JSON)
        assert resp.status_code == 413 and resp.json()["detail"].endswith(f"exceeds the limit of {1 << 20} bytes")
    assert client.get("/v1/runs/r1").status_code == 404  # nothing registered
    small = client.post("/v1/runs", content=pad.replace(b"x" * (1 << 20), b"x" * 1000), headers=JSON)
    assert small.status_code == 201
    # A batch may still be as large as the collector's limit: this one is refused for its content.
    batch = json.dumps({**_batch(), "records": [{"kind": "step", "step": -1, "ts": 1.0}] * 60_000}).encode()
    assert len(batch) > 2 << 20
    assert client.post("/v1/batches", content=batch, headers=JSON).status_code == 422


def test_chunked_body_without_length_is_held_to_the_limit_too(client: TestClient) -> None:
    client.post("/v1/runs", json={"run": "r1"})
    big = json.dumps(_batch(steps=range(4000))).encode()

    def chunks():  # no Content-Length: the body limit must be enforced while reading
        for i in range(0, len(big), 4096):
            yield big[i : i + 4096]

    resp = client.post("/v1/batches", content=chunks(), headers={"content-type": "application/json"})
    # the route's own check (the middleware's message names the declared length)
    assert resp.status_code == 413 and resp.json()["detail"].startswith("request body exceeds the limit")
    assert client.get("/v1/runs/r1").json()["step_records"] == 0


def test_metrics_and_openapi(client: TestClient) -> None:
    client.post("/v1/runs", json={"run": "r1"})
    client.post("/v1/batches", json=_batch())
    client.app.state.worker.run_once()  # what the background thread does every few seconds
    text = client.get("/metrics").text
    assert 'trainvitals_run_latest_step{run="r1"} 2.0' in text
    assert 'trainvitals_ingest_records_total{run="r1"} 3.0' in text
    assert 'trainvitals_run_rank_step_seconds{run="r1",stat="p50"} 0.25' in text
    paths = client.get("/openapi.json").json()["paths"]
    assert {"/v1/runs", "/v1/batches", "/metrics", "/healthz"} <= set(paths)


def test_csv_columns_follow_the_response_models(client: TestClient) -> None:
    client.post("/v1/runs", json={"run": "r1"})
    records = _batch(steps=range(3))["records"] + [
        {"kind": "checkpoint", "step": 2, "generation": 1, "status": "persisted", "ts": 2.0, "bytes": 10**9}
    ]
    client.post("/v1/batches", json={**_batch(), "records": records})
    header = client.get("/v1/runs", params={"format": "csv"}).text.splitlines()[0]
    assert header == "run,project,status,world_size,created_at,last_seen_at"
    assert client.get("/v1/runs/r1", params={"format": "csv"}).text.splitlines()[:2] == ["key,value", "run_id,r1"]
    matrix = client.get("/v1/runs/r1/ranks/step-times", params={"start": 0, "end": 2, "format": "csv"})
    assert matrix.headers["content-type"].startswith("text/csv")
    assert matrix.text.splitlines() == ["step,rank0", "0,0.25", "1,0.25", "2,0.25"]
    # A number on both backends (PostgreSQL's sum() of a bigint column is a NUMERIC).
    assert client.get("/v1/runs/r1/checkpoints").json()[0]["bytes"] == 10**9
    assert client.get("/v1/runs/r1/rollback").json()["target"]["bytes"] == 10**9


def test_a_large_body_refused_by_the_fast_decoder_costs_one_pass(db_url: str) -> None:
    """Over 256 KiB, a body msgspec refuses is not re-validated record by record by pydantic: it
    gets msgspec's first error, or, when the lax rules may take it (NaN as the agent's json.dumps
    writes it, a number as a string), one json.loads and a lax conversion: taken, nothing lost."""
    settings = Settings(db=db_url, run_analysis=False, auth=False, settle_seconds=0)
    with TestClient(create_app(settings)) as client:
        client.post("/v1/runs", json={"run": "r1"})
        batch = _batch(steps=range(4000))
        assert len(json.dumps(batch)) > 256 << 10
        batch["records"][3999]["loss"] = float("nan")  # json.dumps writes NaN
        batch["records"][3998]["step_seconds"] = "0.5"
        body = json.dumps(batch)
        ok = client.post("/v1/batches", content=body, headers={"content-type": "application/json"})
        assert ok.json() == {"accepted": 4000, "duplicate": False}
        bad = _batch(seq=1, steps=range(4000))
        bad["records"][7]["step"] = -1
        bad["records"][9]["step"] = -1
        refused = client.post("/v1/batches", json=bad)
        assert refused.status_code == 422
        assert refused.json()["message"] == "invalid request, nothing stored: records.7.step: Expected `int` >= 0"
        assert client.get("/v1/runs/r1").json()["step_records"] == 4000


def test_a_rollback_without_a_target_says_why(client: TestClient) -> None:
    """"Which checkpoint do we roll back to" answered null with the reason "newest usable generation",
    whether the run recorded no save or only failed and late ones."""
    client.post("/v1/runs", json={"run": "r1"})
    client.post("/v1/batches", json=_batch())
    none = client.get("/v1/runs/r1/rollback").json()
    assert none["target"] is None and none["generations_considered"] == 0
    assert none["reason"] == (
        "newest usable generation: none, no checkpoint save was recorded for this run (agent.checkpoint(...) "
        "or agent.save(...) records one)"
    )
    saves = [
        {"kind": "checkpoint", "step": 1, "generation": 1, "status": "started", "ts": 1.0},
        {"kind": "checkpoint", "step": 1, "generation": 1, "status": "failed", "ts": 1.5, "error": "disk full"},
        {"kind": "checkpoint", "step": 2, "generation": 2, "status": "started", "ts": 2.0},
        {"kind": "checkpoint", "step": 5, "generation": 5, "status": "persisted", "ts": 5.0},
    ]
    client.post("/v1/batches", json={**_batch(seq=1), "records": saves})
    late = client.get("/v1/runs/r1/rollback", params={"before_step": 4}).json()
    assert late["target"] is None and late["generations_considered"] == 3
    assert late["reason"] == (
        "before step 4: none, of 3 recorded generation(s) none was persisted before step 4 (1 failed, 1 started "
        "and never persisted, 1 at or after step 4)"
    )
    assert client.get("/v1/runs/r1/rollback").json()["target"]["generation"] == 5


def test_a_generation_deleted_since_its_save_is_no_rollback_target(client: TestClient) -> None:
    """A generation the job's retention removed (recorded deleted by the agent's sweep) was still
    named: the answer is the newest one whose files remain, and it says what was passed over."""
    client.post("/v1/runs", json={"run": "r1"})
    why = "/ck/checkpoint-4 removed after its save (the job's retention: save_total_limit, save_top_k, keep_last)"
    saves = [
        {"kind": "checkpoint", "step": s, "generation": s, "status": "persisted", "ts": float(s),
         "path": f"/ck/checkpoint-{s}"}
        for s in (2, 4, 6)
    ] + [{"kind": "checkpoint", "step": 4, "generation": 4, "status": "deleted", "ts": 7.0, "path": "/ck/checkpoint-4",
          "error": why}]  # fmt: skip
    client.post("/v1/batches", json={**_batch(), "records": saves})
    answer = client.get("/v1/runs/r1/rollback", params={"before_step": 5}).json()
    assert answer["target"]["generation"] == 2 and answer["target"]["path"] == "/ck/checkpoint-2"
    passed_over = f"; 1 newer generation(s) before it deleted since their save (step 4: {why})"
    assert answer["reason"] == "before step 5" + passed_over
    deleted = [g for g in client.get("/v1/runs/r1/checkpoints").json() if g["generation"] == 4]
    assert deleted[0]["status"] == "deleted" and deleted[0]["path"] == "/ck/checkpoint-4" and deleted[0]["ts"] == 4.0


def test_a_restarted_ranks_deletion_lands_on_the_save_of_the_incarnation_it_names(client: TestClient) -> None:
    """After a restart the agent's deleted records about its previous process's saves carry that
    process's incarnation: stored under it, they retire that save and not the relaunch's own save of
    the same generation number (a resume from an earlier generation saves over the old ones). A
    deletion of a save the collector never stored (a ledger left by an earlier job under the run id)
    is not listed."""
    client.post("/v1/runs", json={"run": "r1"})
    first = [
        {"kind": "checkpoint", "step": s, "generation": s, "status": "verified", "ts": float(s),
         "path": f"/ck/step-{s}"}
        for s in (10, 20)
    ]  # fmt: skip
    client.post("/v1/batches", json={**_batch(), "records": first})
    over = "/ck/step-20 overwritten at the same path by generation 20 (step 20)"
    relaunch = [
        {"kind": "checkpoint", "step": 20, "generation": 20, "status": "verified", "ts": 30.0, "path": "/ck/step-20"},
        {"kind": "checkpoint", "step": 20, "generation": 20, "status": "deleted", "ts": 31.0, "path": "/ck/step-20",
         "error": over, "saved_by_incarnation": 1},
        {"kind": "checkpoint", "step": 7, "generation": 7, "status": "deleted", "ts": 31.0, "path": "/old/step-7",
         "error": "gone", "saved_by_incarnation": 0},
    ]  # fmt: skip
    assert client.post("/v1/batches", json={**_batch(), "incarnation": 2, "records": relaunch}).status_code == 200
    gens = client.get("/v1/runs/r1/checkpoints").json()
    assert [(g["generation"], g["incarnation"], g["status"]) for g in gens] == [
        (10, 1, "verified"), (20, 1, "deleted"), (20, 2, "verified")
    ]  # fmt: skip
    target = client.get("/v1/runs/r1/rollback", params={"before_step": 25}).json()["target"]
    assert (target["generation"], target["incarnation"]) == (20, 2)


def test_a_misspelt_query_parameter_is_a_422_naming_what_the_route_takes(client: TestClient) -> None:
    """`?active_only=true` (the query function's name) returned every finding, `?before=` fell back
    to the default rollback and `?limit=` the default k, all with a 200: an answer to another question."""
    client.post("/v1/runs", json={"run": "r1"})
    for path, wrong, taken in (
        ("/v1/runs/r1/findings", "active_only", "active, format, project"),
        ("/v1/runs/r1/rollback", "before", "before_step, format, project"),
        ("/v1/runs/r1/tensors/worst", "limit", "end, format, k, project, start"),
        ("/v1/runs", "run", "format, project"),
        ("/v1/runs/r1/advice/checkpoints", "mtbf", "detect_s, mtbf_s, project, restart_s, sdc_latency_s"),
    ):
        resp = client.get(path, params={wrong: "1"})
        assert resp.status_code == 422, path
        assert resp.json()["detail"] == f"unknown query parameter {wrong!r}: this route takes {taken}", path
    assert client.get("/v1/runs/r1/findings", params={"active": "true", "format": "json"}).status_code == 200


def test_a_reversed_range_and_an_unknown_tensor_are_said(client: TestClient) -> None:
    """A reversed step range was an empty 200 on the tensor routes (a 422 on step-times), and a
    misspelt tensor an empty timeline, where the CLI says both."""
    client.post("/v1/runs", json={"run": "r1"})
    for path in ("/v1/runs/r1/tensors/worst", "/v1/runs/r1/tensors/fc1/timeline", "/v1/runs/r1/ranks/step-times"):
        resp = client.get(path, params={"start": 500, "end": 100})
        assert (resp.status_code, resp.json()) == (422, {"detail": "start=500 is after end=100: need start <= end"})
    resp = client.get("/v1/runs/r1/tensors/model.layers.3.fc/timeline")
    assert resp.status_code == 404 and "run 'r1' has no tensor 'model.layers.3.fc'" in resp.json()["detail"]


def test_a_timeline_of_a_role_the_tensor_lacks_is_a_404_naming_its_roles(client: TestClient) -> None:
    """A role the tensor has no statistics for answered 200 [], read as "nothing in this range"."""
    client.post("/v1/runs", json={"run": "r1"})
    records = [{"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 0.25}] + [
        {"kind": "tensor", "step": 0, "tensor": "fc1", "role": role, "format": "e4m3", "amax": 1.0,
         "headroom_bits": 8.0}
        for role in ("input", "weight")
    ]
    assert client.post("/v1/batches", json={**_batch(), "records": records}).status_code == 200
    client.app.state.worker.run_once()
    resp = client.get("/v1/runs/r1/tensors/fc1/timeline", params={"role": "grad_output"})
    assert (resp.status_code, resp.json()["detail"]) == (
        404,
        "run 'r1': tensor 'fc1' has roles input, weight, not grad_output: pass one of them as role, or leave role out",
    )
    assert [r["role"] for r in client.get("/v1/runs/r1/tensors/fc1/timeline", params={"role": "weight"}).json()] == [
        "weight"
    ]
    resp = client.get("/v1/runs/r1/tensors/fc1/timeline", params={"role": "input", "start": 5, "end": 9})
    assert (resp.status_code, resp.json()) == (200, [])  # the role is there, the range holds none of it


def test_an_answer_too_large_to_hold_is_refused_not_cut_short(client: TestClient, monkeypatch) -> None:
    """The step-time matrix was cut at its cell limit: the last step's missing ranks read as None,
    which the API uses for a rank that sent nothing (a straggler signal)."""
    from trainvitals.service.store import queries

    client.post("/v1/runs", json={"run": "r1", "parallelism": {"world_size": 2}})
    for rank in (0, 1):
        assert client.post("/v1/batches", json=_batch(rank=rank, steps=range(3))).status_code == 200
    monkeypatch.setattr(queries.step_time_matrix, "__kwdefaults__", {"max_cells": 5})  # 6 cells stored
    resp = client.get("/v1/runs/r1/ranks/step-times", params={"start": 0, "end": 2})
    assert resp.status_code == 422
    assert resp.json()["detail"].startswith("steps 0..2 hold more than 5 rank step times, the most one answer holds")
    monkeypatch.setattr(queries.step_time_matrix, "__kwdefaults__", {"max_cells": 6})
    matrix = client.get("/v1/runs/r1/ranks/step-times", params={"start": 0, "end": 2}).json()
    assert matrix["seconds"] == [[0.25, 0.25]] * 3


def test_a_registration_the_database_refuses_is_a_422(client: TestClient) -> None:
    """A NUL character, which PostgreSQL cannot store, in the project was a 500 with auth off."""
    resp = client.post("/v1/runs", json={"run": "r1", "project": "a\u0000b"})
    assert resp.status_code == 422 and "project" in json.dumps(resp.json()["detail"])
    resp = client.post("/v1/runs", json={"run": "r2", "tags": {"note": "a\u0000b"}})
    assert resp.status_code in (201, 422)  # SQLite stores it; PostgreSQL's JSON refuses it: never a 500
    if resp.status_code == 422:
        assert "nothing stored" in resp.json()["detail"]


def test_a_nul_in_a_tensor_or_group_name_is_a_422_that_names_it(client: TestClient) -> None:
    """A NUL reaches the collector only as the escape \\u0000, which sends the body through the
    decoder that checks names for it (the common body, with no backslash, skips that check)."""
    client.post("/v1/runs", json={"run": "r1"})
    tensor = {"kind": "tensor", "step": 0, "tensor": "fc1", "role": "input", "format": "e4m3", "amax": 1.0}
    grad = {"kind": "grad", "step": 0, "group": "layers.0", "owned_sq": 1.0, "local_sq": 1.0}
    for field, record in (("tensor", tensor), ("group", grad)):
        bad = {**_batch(), "records": [{**record, field: "a\u0000b"}]}
        resp = client.post("/v1/batches", json=bad)
        locs = [e["loc"] for e in resp.json()["detail"]]  # pydantic's: body, records, 0, the record's kind, field
        assert resp.status_code == 422 and ["body", "records", 0, record["kind"], field] in locs, locs
    assert client.get("/v1/runs/r1").json()["step_records"] == 0
    assert client.post("/v1/batches", json={**_batch(), "records": [tensor, grad]}).json()["accepted"] == 2


def test_read_answers_hold_non_finite_values_as_null_formulas_quoted_and_headers(client: TestClient) -> None:
    """An overflowed amax is data (the wire takes Infinity): the JSON answers must stay strict JSON,
    the CSV ones run no formula a tensor is named with, and an empty CSV answer is its header."""
    formula = '=HYPERLINK("http://evil.example","click")'
    client.post("/v1/runs", json={"run": "r1"})
    records = [{"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 0.25, "grad_norm": float("inf")}] + [
        {"kind": "tensor", "step": 0, "tensor": name, "role": "input", "format": "e4m3", "amax": amax,
         "headroom_bits": -1.5, "nonfinite": 4}
        for name, amax in ((formula, 1.0), ("fc1", float("inf")))
    ]  # fmt: skip
    body = json.dumps({**_batch(), "records": records})  # Infinity as the agent sends it
    assert client.post("/v1/batches", content=body, headers={"content-type": "application/json"}).status_code == 200
    client.app.state.worker.run_once()

    def strict(text: str) -> object:
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))

    resp = client.get("/v1/runs/r1/tensors/fc1/timeline")
    assert resp.status_code == 200
    assert [(r["amax"], r["nonfinite"]) for r in strict(resp.text)] == [(None, 4)]
    resp = client.get("/v1/runs/r1/tensors/worst")
    assert resp.status_code == 200 and {r["max_amax"] for r in strict(resp.text)} == {1.0, None}
    worst = client.get("/v1/runs/r1/tensors/worst", params={"format": "csv"}).text.splitlines()
    quoted = '"\'=HYPERLINK(""http://evil.example"",""click"")"'  # a leading ' and RFC 4180's quotes
    assert sorted(worst[1:]) == [f"{quoted},input,-1.5,1.0,1,,0,0", "fc1,input,-1.5,,1,,0,0"]
    assert client.get("/v1/runs/r1/checkpoints", params={"format": "csv"}).text == (
        ",".join(schemas.CheckpointGenerationPublic.model_fields) + "\n"
    )


def test_a_storage_failure_is_a_503_with_retry_after_on_registration_and_ingest(tmp_path) -> None:
    """The database fails under the collector (here a table gone; a full disk alike): the
    registration answered 500 with no text, the batch 503 with no Retry-After. Both are 503 with
    the driver's line and a Retry-After for HTTP clients and proxies (the agent backs off itself)."""
    import sqlite3

    from trainvitals.service.store import db

    url = f"sqlite:///{tmp_path / 'tv.db'}"
    db.upgrade(url)
    app = create_app(Settings(db=url, run_analysis=False, auth=False))
    with TestClient(app, raise_server_exceptions=False) as c:
        assert c.post("/v1/runs", json={"run": "r1"}).status_code == 201
        with sqlite3.connect(tmp_path / "tv.db") as conn:
            conn.execute("ALTER TABLE steps RENAME TO steps_gone")
            conn.execute("ALTER TABLE runs RENAME TO runs_gone")
        for response in (c.post("/v1/runs", json={"run": "r2"}), c.post("/v1/batches", json=_batch())):
            assert response.status_code == 503, response.text
            assert response.headers.get("retry-after") == "5"
            assert "OperationalError: no such table" in response.json()["detail"]
