"""Baseline runs end to end: named at registration, used by the collector's analysis (replay runs
the live pipeline); named per request by the HTTP analysis route and `trainvitals query analysis`;
an unknown baseline or another project's run is a 404 / a one-line CLI error, never read."""

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from trainvitals.service import cli
from trainvitals.service.ingest.replay import replay_files
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db, queries
from trainvitals.testing.scenarios import Layout, make_scenario, scenario_key, to_wire_lines
from trainvitals.wire import RunRegistration

# A small job (2 ranks, 1 layer) keeps the two replays quick; the step series is the full 5,000 steps.
LAYOUT = Layout(pp=2, dp=1, ranks_per_node=2, layers=1)
RUN = make_scenario("healthy_end_rise", 100, layout=LAYOUT)
BASE = make_scenario("healthy_end_rise", 100, layout=LAYOUT, noise_seed=1)  # the previous run of the recipe


def _kinds(findings: list[dict]) -> set[str]:
    return {f["kind"] for f in findings if f["severity"] != "info"}


def test_baseline_named_at_registration_and_per_request(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run, base = RUN.series.run, BASE.series.run
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        # The baseline is recorded first (it is the earlier run), then the run that names it.
        for sc, baseline in ((BASE, None), (RUN, base)):
            path = tmp_path / f"{sc.series.run}.jsonl"
            path.write_text("".join(line + "\n" for line in to_wire_lines(sc, baseline_run=baseline)))
            assert replay_files(session, [str(path)]).rejected_lines == 0
        # Alone, the end-of-training rise is a drift ticket; against the registered baseline, nothing.
        assert _kinds(queries.findings(session, run_id=scenario_key(base))) == {"grad_norm_drift"}
        assert _kinds(queries.findings(session, run_id=scenario_key(run))) == set()
        batches.register_run(session, RunRegistration(run="elsewhere-run", project="elsewhere"))
    engine.dispose()

    with TestClient(create_app(Settings(db=db_url, auth=False, run_analysis=False))) as client:
        url = f"/v1/runs/{base}/analysis"
        assert _kinds(client.get(url).json()) == {"grad_norm_drift"}  # no baseline registered
        assert _kinds(client.get(url, params={"baseline": run}).json()) == set()  # named for this request
        assert _kinds(client.get(f"/v1/runs/{run}/analysis").json()) == set()  # the registered one
        header = client.get(url, params={"format": "csv"}).text.splitlines()[0]
        assert header.endswith(",active,detected_step,paged_step")
        for other in ("no-such-run", "elsewhere-run"):  # another project's run reads like a missing one
            reply = client.get(url, params={"baseline": other})
            assert reply.status_code == 404
            assert reply.json()["detail"] == (
                f"no run {other!r} in project 'synthetic' to compare with: name a run of the same project "
                "(trainvitals query runs, GET /v1/runs)"
            )
        assert client.get(url, params={"baseline": base}).status_code == 404  # the run itself

    query = ["query", "analysis", "--db", db_url, "--run", base]
    assert cli.main([*query, "--baseline", run]) == 0
    assert _kinds(json.loads(capsys.readouterr().out)) == set()
    assert cli.main([*query, "--baseline", "elsewhere-run"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("trainvitals: no run 'elsewhere-run' in project 'synthetic'")
