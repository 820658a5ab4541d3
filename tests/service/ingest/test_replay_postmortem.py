"""Replay a recorded wire stream through the live ingest path, then answer the post-mortem
questions over HTTP and the CLI: when did it start, where, which checkpoint to roll back to."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from trainvitals.service.detectors.run_all import detect
from trainvitals.service.ingest.replay import replay_files
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db, queries
from trainvitals.testing.scenarios import Layout, make_scenario, prefix, scenario_key, to_wire_lines
from trainvitals.wire import RunRegistration

CLI = [sys.executable, "-m", "trainvitals.service.cli"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    # A small job layout (2 ranks, 3 layers) keeps the replay quick; the timeline is the full 4,700 steps.
    scenario = make_scenario("late_divergence", seed=3, layout=Layout(pp=2, dp=1, ranks_per_node=2, layers=3))
    path = tmp_path_factory.mktemp("rec") / "late_divergence.jsonl"
    path.write_text("".join(line if line.endswith("\n") else line + "\n" for line in to_wire_lines(scenario)))
    return path, scenario


def test_replay_then_postmortem(db_url: str, recorded, tmp_path: Path) -> None:
    """One replay per backend (the scenario is 4,700 steps x 8 ranks), then every question."""
    path, scenario = recorded
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"run": "x", "rank": 0, "incarnation": 0, "seq": 0, "records": [{"kind": "step"}]}\nnot json\n'
    )
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        first = replay_files(session, [str(path), str(bad)])
        assert first.rejected_lines == 2 and first.batches > 0 and first.duplicates == 0
        assert any("bad.jsonl:2" in e for e in first.errors)
        again = replay_files(session, [str(path)], analyse=False)
        assert again.duplicates == again.batches and again.records == 0
        run_id = scenario_key(scenario.series.run)
        assert (
            queries.count_step_rows(session, run_id=run_id)
            == len(scenario.series.steps.steps) * scenario.layout.world
        )
        # The collector's findings after replay equal the detectors run offline on the scenario.
        stored = {
            (f["kind"], f["subject"], f["onset_step"]) for f in queries.findings(session, run_id=run_id)
        }
    engine.dispose()
    offline = {(f.kind, f.subject, f.onset_step) for f in detect(scenario.series)}
    assert stored == offline
    assert any(k in {kind for kind, _s, _o in stored} for k in scenario.expect_kinds)

    # The CLI replays through the same path: everything is a duplicate now.
    out = subprocess.run(
        [*CLI, "replay", str(path), "--db", db_url, "--no-analysis"], capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["runs"] == [run_id] and json.loads(out.stdout)["records"] == 0  # keys
    with TestClient(create_app(Settings(db=db_url, auth=False, run_analysis=False))) as client:
        findings = client.get(f"/v1/runs/{scenario.series.run}/findings").json()
        assert findings, "the injected divergence must be found"
        onset = min(
            f["onset_step"]
            for f in findings
            if f["severity"] in ("page", "ticket") and f["active"] and f["kind"].startswith(("loss_", "grad_", "fp8_"))
        )
        rollback = client.get(f"/v1/runs/{scenario.series.run}/rollback").json()
        assert rollback["before_step"] == onset
        assert rollback["target"]["step"] < onset
        assert rollback["target"]["status"] in ("verified", "persisted")
        gens = client.get(f"/v1/runs/{scenario.series.run}/checkpoints").json()
        assert rollback["target"]["step"] == max(
            g["step"] for g in gens if g["step"] < onset and g["status"] in ("verified", "persisted")
        )
        csv_text = client.get(f"/v1/runs/{scenario.series.run}/checkpoints", params={"format": "csv"}).text
        assert csv_text.splitlines()[0].startswith("generation,step,")
        worst = client.get(f"/v1/runs/{scenario.series.run}/tensors/worst", params={"k": 3}).json()
        assert len(worst) == 3 and worst[0]["min_headroom_bits"] <= worst[-1]["min_headroom_bits"]
        tensor, role = worst[0]["tensor"], worst[0]["role"]
        timeline = client.get(
            f"/v1/runs/{scenario.series.run}/tensors/{tensor}/timeline", params={"role": role, "start": 100, "end": 200}
        ).json()
        assert timeline and all(100 <= r["step"] <= 200 and r["role"] == role for r in timeline)
        matrix = client.get(f"/v1/runs/{scenario.series.run}/ranks/step-times", params={"start": 10, "end": 19}).json()
        assert matrix["steps"] == list(range(10, 20)) and len(matrix["ranks"]) == scenario.layout.world
        assert all(v is not None for row in matrix["seconds"] for v in row)
        assert client.get("/v1/runs/nope/findings").status_code == 404
    cli = subprocess.run(
        [*CLI, "query", "rollback", "--db", db_url, "--run", run_id], capture_output=True, text=True
    )
    assert json.loads(cli.stdout)["target"]["step"] == rollback["target"]["step"]
    cli_csv = subprocess.run(
        [
            *CLI,
            "query",
            "step-times",
            "--db",
            db_url,
            "--run",
            run_id,
            "--start",
            "0",
            "--end",
            "4",
            "--format",
            "csv",
        ],
        capture_output=True,
        text=True,
    )
    assert cli_csv.stdout.splitlines()[0] == "step," + ",".join(f"rank{r}" for r in matrix["ranks"])
    assert len(cli_csv.stdout.splitlines()) == 6


@pytest.mark.parametrize("shadow", [False, True], ids=["trains_in_fp8", "bf16_shadow"])
def test_shadow_fp8_findings_never_move_the_rollback_target(db_url: str, tmp_path: Path, shadow: bool) -> None:
    """An amax creep recorded by a run that trains in FP8 pages and sets the rollback target
    before its onset; recorded by the shadow monitor of a bf16 run, the same findings are stored
    as information and the rollback target stays the newest usable generation."""
    sc = make_scenario("fp8_amax_creep", seed=11, layout=Layout(pp=1, dp=1, ranks_per_node=1, layers=3))
    assert sc.loss_move_step is not None
    series = prefix(sc.series, sc.loss_move_step - 1)  # before the loss moves: FP8 findings only
    if shadow:
        series = dataclasses.replace(series, tensors=[dataclasses.replace(t, shadow=True) for t in series.tensors])
    sc = dataclasses.replace(sc, series=series)
    path = tmp_path / "creep.jsonl"
    path.write_text("".join(line + "\n" for line in to_wire_lines(sc)))
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        replay_files(session, [str(path)])
        stored = queries.findings(session, run_id=scenario_key(series.run))
        rollback = queries.rollback_target(session, run_id=scenario_key(series.run))
    engine.dispose()
    fp8 = [f for f in stored if f["kind"].startswith("fp8_")]
    assert fp8 and {f["kind"] for f in fp8} >= {"fp8_headroom_trend"}
    if shadow:
        assert all(f["severity"] == "info" and "does not train in FP8" in f["summary"] for f in fp8)
        assert rollback["before_step"] is None and rollback["reason"] == "newest usable generation"
    else:
        assert any(f["severity"] == "page" for f in fp8)
        onset = min(f["onset_step"] for f in fp8 if f["severity"] in ("page", "ticket") and f["active"])
        assert rollback["before_step"] == onset and rollback["target"]["step"] < onset


def test_replay_analyses_the_tail_a_dying_job_left_incomplete(db_url: str, tmp_path: Path) -> None:
    """A recording of a job that died: rank 1 stopped at step 49, rank 0 went on to step 99 with its
    loss NaN from step 90, and no stop event. Replay judged the run as of its last step, where the
    steps rank 1 never sent had not waited their settle time: steps 70..99 stayed unreduced, and
    the NaN loss was never found."""
    lines = [RunRegistration(run="died", parallelism={"world_size": 2}).model_dump_json()]
    for rank, last in ((0, 99), (1, 49)):
        for seq, first in enumerate(range(0, last + 1, 10)):
            records = [{"kind": "step", "step": s, "ts": 1000.0 + s, "step_seconds": 1.0,
                        "loss": float("nan") if s >= 90 else 2.0}
                       for s in range(first, min(first + 10, last + 1))]  # fmt: skip
            lines.append(json.dumps({"run": "died", "rank": rank, "incarnation": 1, "seq": seq, "records": records}))
    path = tmp_path / "died.jsonl"
    path.write_text("\n".join(lines) + "\n")
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        report = replay_files(session, [str(path)])
        found = queries.findings(session, run_id=report.runs[0])
    engine.dispose()
    assert report.steps_reduced == 100
    nonfinite = [f for f in found if f["kind"] == "loss_nonfinite"]
    assert nonfinite and nonfinite[0]["onset_step"] == 90


def test_a_replayed_recording_is_exposed_for_its_own_span_not_until_the_replay(db_url: str, tmp_path: Path) -> None:
    """The checkpoint advisor's exposure ran from the run's start to when the collector last saw
    it: for a recording replayed a month later, a month (and failures looked a month apart)."""
    lines = [RunRegistration(run="old", parallelism={"world_size": 1}, started_at=1000.0).model_dump_json()]
    records = [{"kind": "step", "step": s, "ts": 1000.0 + 10 * s, "step_seconds": 10.0} for s in range(1, 31)]
    lines.append(json.dumps({"run": "old", "rank": 0, "incarnation": 1, "seq": 0, "records": records}))
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(lines) + "\n")
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        report = replay_files(session, [str(path)], analyse=False)
        _saves, _failures, exposure = queries.observed_cadence_inputs(session, run_id=report.runs[0])
    engine.dispose()
    assert exposure == 300.0
