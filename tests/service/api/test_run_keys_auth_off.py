"""Run ids with auth off, on both backends: nothing names a project, so an id must name one run.

A run of a non-default project is found by its id alone; an id another project holds cannot be
registered; and where runs of several projects share an id (registered while auth was on) a read
asks for the project, a batch is refused in one line, and /metrics never merges the two."""

import json

import pytest
from fastapi.testclient import TestClient

from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db
from trainvitals.wire import RunRegistration


@pytest.fixture
def client(db_url: str):
    with TestClient(create_app(Settings(db=db_url, run_analysis=False, auth=False, settle_seconds=0))) as c:
        yield c


def _batch(run: str, seq: int, steps: int) -> dict:
    records = [{"kind": "step", "step": s, "ts": 1.0, "step_seconds": 0.25} for s in range(steps)]
    return {"run": run, "rank": 0, "incarnation": 1, "seq": seq, "records": records}


def test_a_projects_run_is_found_by_its_id_and_ids_stay_unique(client: TestClient) -> None:
    assert client.post("/v1/runs", json={"run": "x", "project": "team-a"}).status_code == 201
    assert client.post("/v1/batches", json=_batch("x", 0, 4)).json()["accepted"] == 4
    overview = client.get("/v1/runs/x").json()
    assert (overview["run_id"], overview["project"], overview["step_records"]) == ("x", "team-a", 4)
    taken = client.post("/v1/runs", json={"run": "x"})  # the default project
    assert taken.status_code == 409 and "taken by another project" in taken.json()["detail"]
    assert 'run="team-a/x"' in client.get("/metrics").text  # a scrape of every project: the run's key


def test_a_runs_label_stays_when_another_projects_run_with_its_id_appears(client: TestClient, db_url: str) -> None:
    """The label was the run id until a run of another project with the same id was live, then the
    key, then the id again: every series of the run became a new one and alerts' `for:` restarted."""
    assert client.post("/v1/runs", json={"run": "x", "project": "a"}).status_code == 201
    assert client.post("/v1/runs", json={"run": "d"}).status_code == 201  # the default project's
    alone = client.get("/metrics").text
    assert 'trainvitals_run_world_size_ranks{run="a/x"}' in alone
    assert 'trainvitals_run_world_size_ranks{run="d"}' in alone  # the default project's keys are bare ids
    engine = db.make_engine(db_url)  # as a collector with auth on would store it
    with db.make_sessionmaker(engine)() as session:
        batches.register_run(session, RunRegistration(run="x", project="b"))
    engine.dispose()
    both = client.get("/metrics").text
    assert 'trainvitals_run_world_size_ranks{run="a/x"}' in both
    assert 'trainvitals_run_world_size_ranks{run="b/x"}' in both
    assert 'trainvitals_run_world_size_ranks{run="d"}' in both


def test_an_id_several_projects_hold_is_asked_about_never_guessed(client: TestClient, db_url: str) -> None:
    engine = db.make_engine(db_url)  # as a collector with auth on would have stored them
    with db.make_sessionmaker(engine)() as session:
        for project in ("a", "b"):
            batches.register_run(session, RunRegistration(run="x", project=project))
        batches.store_batch(session, _as_batch(_batch("x", 0, 2)), project="a")
        batches.store_batch(session, _as_batch(_batch("x", 0, 5)), project="b")
    engine.dispose()
    ambiguous = client.get("/v1/runs/x")
    assert ambiguous.status_code == 409
    assert ambiguous.json()["detail"] == "run 'x' exists in projects 'a', 'b': name one with ?project=..."
    assert client.get("/v1/runs/x?project=b").json()["step_records"] == 5
    assert client.get("/v1/runs/x?project=a").json()["step_records"] == 2
    refused = client.post("/v1/batches", json=_batch("x", 1, 1))
    assert refused.status_code == 409
    assert refused.json()["detail"].startswith("run 'x' exists in projects 'a', 'b'; with auth off a batch cannot")
    # Every project's /metrics: the two runs are two series, labelled by their keys.
    text = client.get("/metrics").text
    assert 'trainvitals_run_world_size_ranks{run="a/x"}' in text
    assert 'trainvitals_run_world_size_ranks{run="b/x"}' in text


def _as_batch(body: dict):
    from trainvitals.wire import Batch

    return Batch.model_validate(body)


def test_the_cli_takes_a_runs_metrics_label(client: TestClient, db_url: str, capsys: pytest.CaptureFixture) -> None:
    """/metrics labels another project's run `a/x`, what on-call copies from an alert; `--run a/x`
    said there was no such run."""
    from trainvitals.service.cli import main

    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        for project, steps in (("a", 2), ("b", 5)):
            batches.register_run(session, RunRegistration(run="x", project=project))
            batches.store_batch(session, _as_batch(_batch("x", 0, steps)), project=project)
    engine.dispose()
    for label, steps in (("a/x", 2), ("b/x", 5)):
        assert main(["query", "step-times", "--db", db_url, "--run", label, "--start", "0", "--end", "9"]) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == list(range(steps)), label
    assert main(["query", "findings", "--db", db_url, "--run", "a/x", "--project", "a"]) == 0
    capsys.readouterr()
    assert main(["query", "findings", "--db", db_url, "--run", "a/x", "--project", "b"]) == 1
    assert capsys.readouterr().err.strip() == (
        "trainvitals: --run 'a/x' names project 'a' and --project names 'b': drop one"
    )
    assert main(["query", "findings", "--db", db_url, "--run", "c/x"]) == 1
    assert "no run 'x' of project 'c'" in capsys.readouterr().err
