"""Findings upsert: onsets are stable while a finding stays open, detected_step and paged_step
are kept, a reopened finding starts afresh; the findings API and CLI show all three steps. The
same rules on findings held in memory (`fold_findings`, the analysis on request's) give what the
store keeps."""

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from trainvitals.service import cli
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, queries
from trainvitals.service.store.findings import fold_findings, store_findings
from trainvitals.service.store.models import FindingRow
from trainvitals.wire import Batch, RunRegistration

STRAGGLER = Finding(
    kind="straggler", severity="page", run="r", subject_kind="rank", subject="3", onset_step=600,
    last_step=700, magnitude=1.2, summary="rank 3 is 20% slower than its pipeline stage since step 600",
    detected_step=650,
)  # fmt: skip


def _cycle(session, *findings: Finding, now: float) -> FindingRow:
    """One analysis cycle's upsert; the stored straggler row."""
    store_findings(session, run_id="r", findings=findings, now=now)
    return session.query(FindingRow).filter_by(kind="straggler").one()


def _later(f: Finding, **kw: object) -> Finding:
    return dataclasses.replace(f, **kw)  # type: ignore[arg-type]


def test_open_finding_keeps_its_first_onset_and_detected_step(session) -> None:
    row = _cycle(session, STRAGGLER, now=1.0)
    assert (row.onset_step, row.detected_step, row.active) == (600, 650, True)
    # The lookback slid past step 600: the detector now computes onset 900, detected 950.
    moved = _later(STRAGGLER, onset_step=900, detected_step=950, last_step=1500,
                   summary="rank 3 is 20% slower than its pipeline stage since step 900")  # fmt: skip
    row = _cycle(session, moved, now=2.0)
    assert (row.onset_step, row.detected_step, row.last_step) == (600, 650, 1500)
    assert row.summary.endswith("since step 600")  # the line beside onset_step agrees with it
    # New evidence backdates it: earlier is allowed; detected_step stays.
    row = _cycle(session, _later(moved, onset_step=450, detected_step=460), now=3.0)
    assert (row.onset_step, row.detected_step) == (450, 650)


def test_closed_then_reopened_finding_gets_a_new_onset_and_detected_step(session) -> None:
    _cycle(session, STRAGGLER, now=1.0)
    closed = _cycle(session, _later(STRAGGLER, active=False, onset_step=620, detected_step=660), now=2.0)
    assert (closed.active, closed.onset_step, closed.detected_step) == (False, 600, 650)  # same episode
    assert not _cycle(session, now=3.0).active  # not reported at all: stays closed
    reopened = _cycle(session, _later(STRAGGLER, onset_step=2000, detected_step=2100, last_step=2200), now=4.0)
    assert (reopened.active, reopened.onset_step, reopened.detected_step) == (True, 2000, 2100)
    assert reopened.first_seen_at == 1.0  # one row per (run, kind, subject)


def test_a_later_episode_seen_only_closed_is_new_too(session) -> None:
    """Replay runs the detectors once per chunk: an episode can open and close between two
    upserts. Raised after the stored one ended, it is another episode, not a move of the old onset."""
    _cycle(session, _later(STRAGGLER, active=False), now=1.0)
    later = _cycle(session, _later(STRAGGLER, active=False, onset_step=3000, detected_step=3050, last_step=3200),
                   now=2.0)  # fmt: skip
    assert (later.onset_step, later.detected_step) == (3000, 3050)


def test_a_ticket_that_escalates_keeps_the_step_it_first_paged_at(session) -> None:
    """paged_step was held in memory only: the stored row had no column for it, so a post-mortem could
    not read from the collector when a ticket became a page, and the detector's own recomputation over
    a later lookback would have moved it later."""
    ticket = _later(STRAGGLER, severity="ticket", paged_step=None)
    row = _cycle(session, ticket, now=1.0)
    assert (row.severity, row.detected_step, row.paged_step) == ("ticket", 650, None)
    row = _cycle(session, _later(STRAGGLER, last_step=1200, paged_step=1100), now=2.0)
    assert (row.severity, row.detected_step, row.paged_step) == ("page", 650, 1100)
    # The lookback slid: the detector recomputes the page at 1,400. The stored episode paged at 1,100.
    row = _cycle(session, _later(STRAGGLER, onset_step=900, detected_step=950, last_step=1500, paged_step=1400),
                 now=3.0)  # fmt: skip
    assert (row.detected_step, row.paged_step) == (650, 1100)
    # Back to a ticket and closed: the episode's page step stays with it; a new episode starts afresh.
    row = _cycle(session, _later(ticket, active=False, last_step=1600), now=4.0)
    assert (row.active, row.paged_step) == (False, 1100)
    row = _cycle(session, _later(ticket, onset_step=3000, detected_step=3050, last_step=3100), now=5.0)
    assert (row.active, row.detected_step, row.paged_step) == (True, 3050, None)


def test_detected_step_without_a_step_based_detection_is_the_newest_step(session) -> None:
    row = _cycle(session, _later(STRAGGLER, detected_step=None), now=1.0)
    assert row.detected_step == STRAGGLER.last_step


def test_findings_held_in_memory_follow_the_stored_rules(session) -> None:
    """Cycle after cycle, `fold_findings` holds what `store_findings` stores; the held findings
    are not changed in place; paged_step is kept like detected_step."""
    other = _later(STRAGGLER, kind="mfu_gap", subject_kind="run", subject="", summary="low MFU since step 600")
    moved = _later(STRAGGLER, onset_step=900, detected_step=950, last_step=1500, paged_step=950,
                   summary="rank 3 is 20% slower than its pipeline stage since step 900")  # fmt: skip
    cycles = [
        [_later(STRAGGLER, paged_step=650), other],
        [moved],
        [_later(STRAGGLER, active=False, onset_step=620, detected_step=660)],
        [],
        [_later(STRAGGLER, onset_step=2000, detected_step=2100, last_step=2200, paged_step=None, severity="ticket")],
    ]
    held: dict = {}
    for now, findings in enumerate(cycles):
        before = dict(held)
        folded = fold_findings(held, findings)
        assert held == before  # the input is not changed
        held = folded
        store_findings(session, run_id="r", findings=findings, now=float(now))
        rows = {(r.kind, r.subject_kind, r.subject): r for r in session.query(FindingRow)}
        assert held.keys() == rows.keys()
        for key, h in held.items():
            r = rows[key]
            stored = (r.severity, r.onset_step, r.detected_step, r.paged_step, r.last_step, r.magnitude, r.summary,
                      r.active)  # fmt: skip
            assert (h.severity, h.onset_step, h.detected_step, h.paged_step, h.last_step, h.magnitude, h.summary,
                    h.active) == stored  # fmt: skip
        if now == 1:  # open: the first onset, detected and paged step kept; the other one closed
            s = held[("straggler", "rank", "3")]
            assert (s.onset_step, s.detected_step, s.paged_step) == (600, 650, 650)
            assert s.summary.endswith("since step 600") and not held[("mfu_gap", "run", "")].active
    r = held[("straggler", "rank", "3")]
    assert (r.onset_step, r.detected_step, r.paged_step, r.active) == (2000, 2100, None, True)  # a new episode


@pytest.fixture
def stored(db_url: str, session) -> str:
    batches.register_run(session, RunRegistration(run="r"))
    _cycle(session, _later(STRAGGLER, severity="ticket"), now=1.0)
    _cycle(session, _later(STRAGGLER, onset_step=900, detected_step=950, last_step=1500, paged_step=1400), now=2.0)
    return db_url


def test_findings_api_and_cli_show_onset_detected_and_paged_step(
    stored: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with TestClient(create_app(Settings(db=stored, auth=False, run_analysis=False))) as client:
        (api,) = client.get("/v1/runs/r/findings").json()
        header = client.get("/v1/runs/r/findings", params={"format": "csv"}).text.splitlines()[0]
    assert (api["onset_step"], api["detected_step"], api["paged_step"], api["last_step"]) == (600, 650, 1400, 1500)
    assert header.startswith("kind,severity,subject_kind,subject,onset_step,detected_step,paged_step,last_step,")
    assert cli.main(["query", "findings", "--db", stored, "--run", "r"]) == 0
    (shown,) = json.loads(capsys.readouterr().out)
    assert (shown["onset_step"], shown["detected_step"], shown["paged_step"]) == (600, 650, 1400)


def test_the_default_rollback_goes_before_the_first_open_finding_on_the_models_state(session) -> None:
    """It went before the earliest page or ticket of any kind, open or closed: a straggler, a failed
    save or the collector's own analysis error (nothing about which weights are good), or a spike
    the run recovered from long ago, named a far older checkpoint than the divergence needs."""
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 1}), now=1.0)
    saves = [
        {"kind": "checkpoint", "step": s, "generation": s, "status": "persisted", "ts": float(s)}
        for s in (1000, 6000, 7000, 9000)
    ]
    batches.store_batch(session, Batch.model_validate({"run": "r", "rank": 0, "incarnation": 1, "seq": 0,
                                                       "records": saves}), now=1.0)  # fmt: skip

    def finding(kind: str, severity: str, onset: int) -> Finding:
        return Finding(kind=kind, severity=severity, run="r", subject_kind="run", subject="", onset_step=onset,
                       last_step=onset, magnitude=1.0, summary=kind)  # type: ignore[arg-type]  # fmt: skip

    recovered = finding("grad_spike", "ticket", 2000)
    store_findings(session, run_id="r", findings=[recovered], now=2.0)
    store_findings(session, run_id="r", findings=[], now=3.0)  # closed: the run recovered
    open_now = [finding("straggler", "ticket", 3000), finding("checkpoint_failed", "page", 4000),
                finding("analysis_failed", "ticket", 4500), finding("loss_divergence", "page", 8000)]  # fmt: skip
    store_findings(session, run_id="r", findings=open_now, now=4.0)

    answer = queries.rollback_target(session, run_id="r")
    assert answer["before_step"] == 8000 and answer["target"]["step"] == 7000
    assert answer["reason"] == "before the onset of the first open finding (loss_divergence on the run) at step 8000"
    store_findings(session, run_id="r", findings=open_now[:3], now=5.0)  # the divergence closed too
    newest = queries.rollback_target(session, run_id="r")
    assert newest["before_step"] is None and newest["target"]["step"] == 9000
