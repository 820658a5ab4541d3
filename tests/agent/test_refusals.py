"""When the collector refuses: the policy (a table), what the user is told (once, with the
collector's reason, never the token), and delivery that sets refused batches aside so later data
flows, against the real collector with auth on and real tokens. The exporter's thread body runs
synchronously (run_once / flush)."""

import asyncio
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pydantic
import pytest
from fastapi.exceptions import RequestValidationError
from sqlalchemy import select

from tests.conftest import CollectorServer
from trainvitals.agent import AgentConfig
from trainvitals.agent._delivery import spooling_exporter
from trainvitals.agent._notices import Notices, display_url
from trainvitals.agent._processor import BatchProcessor
from trainvitals.agent._refusals import (
    LATER_REGISTRATION_FIELDS,
    AuthWindow,
    reason,
    unknown_later_fields,
    verdict,
    without_absent_later_fields,
)
from trainvitals.agent._transport import HttpTransport, Reply
from trainvitals.service import auth, main
from trainvitals.service.ingest.replay import replay_files
from trainvitals.service.store import db, tokens
from trainvitals.service.store.models import Run, StepRow
from trainvitals.wire import ModelDims, RunRegistration

# --------------------------------------------------------------------------- the policy


@pytest.mark.parametrize(
    ("status", "leftover", "window_s", "expected"),
    [
        (200, False, 300, "delivered"),
        (201, True, 300, "delivered"),
        (401, False, 300, "retry"),  # an operator may fix the token while the job runs
        (403, False, 300, "retry"),
        (403, False, 0, "set_aside"),  # the window is over
        (403, True, 300, "set_aside"),  # an earlier process's leftover does not hold this one's data
        (400, False, 300, "set_aside"),
        (409, False, 300, "set_aside"),
        (413, False, 300, "set_aside"),
        (422, False, 300, "set_aside"),
        (404, False, 300, "retry"),  # the collector's own trouble: retried until it answers
        (429, False, 300, "retry"),
        (503, True, 300, "retry"),
    ],
)
def test_verdict(status: int, leftover: bool, window_s: float, expected: str) -> None:
    assert verdict(status, leftover=leftover, window=AuthWindow(window_s), now=100.0) == expected


def test_the_auth_window_runs_from_the_first_refusal_and_closes_on_acceptance() -> None:
    window = AuthWindow(300.0)
    assert window.refused(1000.0) and window.refused(1299.0)
    assert not window.refused(1300.0)
    window.accepted()
    assert window.refused(5000.0)  # a new window


def test_reason_is_the_collectors_detail() -> None:
    assert reason(Reply(403, b'{"detail": "token is for project \'llm\'"}')) == "token is for project 'llm'"
    errors = [{"loc": ["body", "records", 0, "step", "step_seconds"], "msg": "Input should be >= 0"}] * 5
    text = reason(Reply(422, json.dumps({"detail": errors}).encode()))
    assert text.startswith("body.records.0.step.step_seconds: Input should be >= 0; ") and text.endswith("(+2 more)")
    assert reason(Reply(502, b"<html>Bad Gateway</html>")) == "<html>Bad Gateway</html>"
    assert reason(Reply(500)) == "no reason given"


def test_notices_show_no_credentials_and_each_reason_once(caplog: pytest.LogCaptureFixture) -> None:
    assert display_url("https://user:secret@collector:8443/base?token=x") == "https://collector:8443/base"
    notices = Notices(
        collector="http://u:pw@c:8000", spool=Path("/s.jsonl"), quarantine=Path("/q.jsonl"),
        token="tv_SECRETSECRET", retry_backoff_s=2.0,
    )  # fmt: skip
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    for seq in range(5):  # five batches refused for the same reason: one line
        body = json.dumps({"detail": f"batch {seq} of tv_SECRETSECRET and tv_OTHERTOKEN1"}).encode()
        notices.refused("batch", Reply(422, body), "set_aside", reason=reason(Reply(422, body)), leftover=False,
                        retry_for_s=None, project_named=False)  # fmt: skip
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    assert "http://c:8000" in text and "pw" not in text and "/q.jsonl" in text
    assert "SECRET" not in text and "OTHERTOKEN" not in text
    assert "trainvitals replay /q.jsonl" in text


# --------------------------------------------------------------------------- delivery, for real

STEPS = 6


@pytest.fixture
def secured(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[CollectorServer]:
    """The collector with auth on; a token created while it runs is seen at once (no cache)."""
    monkeypatch.setenv("TRAINVITALS_TOKEN_CACHE_SECONDS", "0")
    server = CollectorServer(db_url, auth=True).start()
    yield server
    server.stop()


def _token(db_url: str, project: str) -> str:
    engine = db.make_engine(db_url)
    with db.make_sessionmaker(engine)() as session:
        token = auth.create_token(session, project=project, scope="ingest")
    engine.dispose()
    return token


def _exporter(
    url: str, tmp_path: Path, *, token: str, project: str | None, incarnation: int = 1, **cfg: object
) -> BatchProcessor:
    config = AgentConfig(
        collector=url, token=token, spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0, **cfg  # type: ignore[arg-type]
    )
    reg = RunRegistration(run="r1", parallelism={"world_size": 1}).model_dump(mode="json")
    del reg["project"]
    if project is not None:
        reg["project"] = project
    return spooling_exporter(config=config, run="r1", rank=0, incarnation=incarnation, registration=reg)


def _emit_steps(exp: BatchProcessor, steps: range) -> None:
    for i in steps:
        exp.emit({"kind": "step", "step": i, "ts": 1.0, "step_seconds": 0.1})
        exp.run_once(deadline=time.monotonic() + 10, ignore_backoff=True)  # one batch per step


def _stored(db_url: str) -> tuple[dict[str, str], list[tuple[int, int]]]:
    """Runs by project (keyed as stored: "<project>/<run>" but for the default project's), and
    (incarnation, step) of every stored step row."""
    engine = db.make_engine(db_url)
    with engine.connect() as conn:
        runs = {r.run_id: r.project for r in conn.execute(select(Run.run_id, Run.project))}
        steps = sorted((r[0], r[1]) for r in conn.execute(select(StepRow.incarnation, StepRow.step)))
    engine.dispose()
    return runs, steps


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "trainvitals.agent" and r.levelno == logging.WARNING]


def test_a_registration_naming_no_project_takes_the_tokens(secured: CollectorServer, tmp_path: Path) -> None:
    exp = _exporter(secured.url, tmp_path, token=_token(secured.db_url, "llm"), project=None)
    _emit_steps(exp, range(STEPS))
    exp.shutdown()
    assert _stored(secured.db_url) == ({"llm/r1": "llm"}, [(1, s) for s in range(STEPS)])
    assert exp.stats.delivered_batches == STEPS and exp.stats.rejected_batches == 0


def test_with_auth_off_a_registration_naming_no_project_goes_to_default(
    collector: CollectorServer, tmp_path: Path
) -> None:
    exp = _exporter(collector.url, tmp_path, token="", project=None)
    _emit_steps(exp, range(2))
    exp.shutdown()
    assert _stored(collector.db_url) == ({"r1": "default"}, [(1, 0), (1, 1)])


def test_a_project_the_token_is_not_for_is_refused_and_said_once(
    secured: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    token = _token(secured.db_url, "llm")
    exp = _exporter(secured.url, tmp_path, token=token, project="other")
    _emit_steps(exp, range(STEPS))
    spool = tmp_path / "spool" / "r1.rank0.jsonl"
    assert _stored(secured.db_url) == ({}, [])  # never stored elsewhere
    assert exp.stats.failed_attempts == STEPS and exp.stats.rejected_batches == 0  # retried in the window
    said = _warnings(caplog)
    assert len(said) == 1, said  # once, not per batch
    assert said[0].startswith(
        f"trainvitals agent: the collector at {secured.url} refused the run registration (403): token is for "
        "project 'llm' with scope 'ingest'; this needs scope 'ingest' on project 'other' (the project comes from "
        "attach(project=) or TRAINVITALS_PROJECT; without either, the token's). Training continues; "
        f"batches wait in {spool} and are retried for 30"
    )
    assert "then set aside in" in said[0] and token not in said[0]
    exp.shutdown(timeout=1.0)
    said = _warnings(caplog)
    assert f"{STEPS} batch(es) were not delivered to the collector at {secured.url}; they wait in {spool}" in said[-1]
    assert f"trainvitals replay {spool} --project <the run's project>" in said[-1]


def test_after_an_unknown_token_the_exit_line_says_fix_the_token_or_replay_with_a_project(
    secured: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The job ended inside the auth window: its spool's registration names no project (the
    collector never answered with one), and the exit line's `trainvitals replay SPOOL` stored the
    run under 'default'."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    exp = _exporter(secured.url, tmp_path, token="tv_unknown_to_this_collector", project=None)
    _emit_steps(exp, range(3))
    exp.shutdown(timeout=0.5)
    spool = tmp_path / "spool" / "r1.rank0.jsonl"
    said = _warnings(caplog)
    assert "refused the run registration (401)" in said[0]
    assert said[-1] == (
        f"trainvitals agent: 3 batch(es) were not delivered to the collector at {secured.url}; they wait in "
        f"{spool}. Fix the token (or the project) and rerun the job: the next start of this rank on this node "
        f"sends them; or store them with: trainvitals replay {spool} --project <the run's project> (add --db "
        "<the collector's database URL> unless it is $TRAINVITALS_DB or ./trainvitals.db)"
    )


def test_a_url_that_is_not_the_collectors_base_names_the_fix_once(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """http://host:8000/v1 (or a Prometheus URL) answers 404 on registration: it was retried as
    the collector's own trouble, forever, with nothing that named the URL as the mistake."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    exp = _exporter(f"{collector.url}/v1", tmp_path, token="", project=None)
    _emit_steps(exp, range(3))
    assert exp.stats.failed_attempts == 3  # still retried: a corrected collector behind it is not ruled out
    exp.shutdown(timeout=0.5)
    refusals = [line for line in _warnings(caplog) if "(404)" in line]
    assert refusals == [
        f"trainvitals agent: the collector at {collector.url}/v1 refused the run registration (404): Not Found "
        "(TRAINVITALS_COLLECTOR must be the collector's base URL, http://host:8000: no /v1, not Prometheus' or "
        f"Grafana's). Training continues; batches wait in {tmp_path / 'spool' / 'r1.rank0.jsonl'} and are retried"
    ]


def test_a_token_fixed_within_the_window_delivers_everything(secured: CollectorServer, tmp_path: Path) -> None:
    later = "tv_created_by_the_operator_later"
    exp = _exporter(secured.url, tmp_path, token=later, project=None)
    _emit_steps(exp, range(3))  # 401: unknown token, retried
    assert exp.stats.failed_attempts == 3 and _stored(secured.db_url) == ({}, [])
    engine = db.make_engine(secured.db_url)
    with db.make_sessionmaker(engine)() as session:
        tokens.add_token(session, digest=auth.digest(later), project="llm", scope="ingest", name=None, now=0.0)
    engine.dispose()
    _emit_steps(exp, range(3, STEPS))
    assert _stored(secured.db_url) == ({"llm/r1": "llm"}, [(1, s) for s in range(STEPS)])
    assert not (tmp_path / "spool" / "r1.rank0.quarantine.jsonl").exists()
    exp.shutdown()


def test_refused_for_good_is_set_aside_then_a_fixed_rerun_delivers_and_the_quarantine_replays(
    secured: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    token = _token(secured.db_url, "llm")
    wrong = _exporter(secured.url, tmp_path, token=token, project="other", auth_retry_s=0.0)
    _emit_steps(wrong, range(STEPS))
    wrong.shutdown()
    quarantine = tmp_path / "spool" / "r1.rank0.quarantine.jsonl"
    assert wrong.stats.rejected_batches == STEPS and wrong.stats.failed_attempts == 0
    assert not (tmp_path / "spool" / "r1.rank0.jsonl").exists()  # nothing waits: later data is not blocked
    # Batches only: their registration was refused, and replaying it would store project 'other'.
    lines = quarantine.read_bytes().splitlines()
    assert len(lines) == STEPS and all(b'"records"' in line for line in lines)
    said = _warnings(caplog)
    assert any(f"Set aside in {quarantine}; later data keeps flowing" in s for s in said), said
    assert f"{STEPS} batch(es) the collector refused are set aside in {quarantine}" in said[-1]

    fixed = _exporter(secured.url, tmp_path, token=token, project=None, incarnation=2)
    _emit_steps(fixed, range(STEPS + 2))
    fixed.shutdown()
    assert _stored(secured.db_url) == ({"llm/r1": "llm"}, [(2, s) for s in range(STEPS + 2)])

    engine = db.make_engine(secured.db_url)
    with db.make_sessionmaker(engine)() as session:
        report = replay_files(session, [str(quarantine)], analyse=False)
    engine.dispose()
    assert report.errors == [] and report.rejected_lines == 0 and report.batches == STEPS
    assert _stored(secured.db_url)[1] == sorted([(1, s) for s in range(STEPS)] + [(2, s) for s in range(STEPS + 2)])


def test_an_earlier_processs_refused_spool_does_not_hold_back_this_ones_data(
    secured: CollectorServer, tmp_path: Path
) -> None:
    token = _token(secured.db_url, "llm")
    wrong = _exporter(secured.url, tmp_path, token=token, project="other")  # 300 s window
    _emit_steps(wrong, range(3))
    wrong.shutdown(timeout=1.0)  # ends inside the window: its batches stay in the spool
    assert (tmp_path / "spool" / "r1.rank0.jsonl").exists()
    fixed = _exporter(secured.url, tmp_path, token=token, project=None, incarnation=2)
    _emit_steps(fixed, range(STEPS))
    assert _stored(secured.db_url) == ({"llm/r1": "llm"}, [(2, s) for s in range(STEPS)])
    assert fixed.stats.rejected_batches == 3  # the leftover's, set aside at once, not after 300 s
    assert len((tmp_path / "spool" / "r1.rank0.quarantine.jsonl").read_bytes().splitlines()) == 3
    fixed.shutdown()


def test_an_invalid_batch_is_set_aside_under_the_registration_the_collector_took(
    secured: CollectorServer, tmp_path: Path
) -> None:
    exp = _exporter(secured.url, tmp_path, token=_token(secured.db_url, "llm"), project=None)
    _emit_steps(exp, range(2))
    exp.emit({"kind": "step", "step": 2, "ts": 1.0, "step_seconds": -1.0})  # 422
    exp.run_once(deadline=time.monotonic() + 10)
    _emit_steps(exp, range(3, 5))
    exp.shutdown()
    assert _stored(secured.db_url)[1] == [(1, 0), (1, 1), (1, 3), (1, 4)]
    registration, batch = (tmp_path / "spool" / "r1.rank0.quarantine.jsonl").read_bytes().splitlines()
    assert json.loads(registration)["project"] == "llm"  # the one the collector filled in
    assert json.loads(batch)["records"][0]["step_seconds"] == -1.0


def _older_model_dims(unknown: frozenset[tuple[str, str]]) -> type[pydantic.BaseModel]:
    """ModelDims as a collector that predates the `unknown` fields has it."""
    return pydantic.create_model(  # type: ignore[call-overload,no-any-return]
        "ModelDims",
        __config__=ModelDims.model_config,
        **{
            name: (field.annotation, field)
            for name, field in ModelDims.model_fields.items()
            if ("model", name) not in unknown
        },
    )


class OlderCollectorTransport(HttpTransport):
    """HTTP to the real collector, which answers a registration as a collector older than the
    wire's later fields (agent/_refusals.py) would: validated against ModelDims without them, the
    422 written by the collector's own handler. A stand-in: there is no earlier release to install,
    so the older collector's answer is built from its own parts (the model, the handler). By
    default older than all of them; `unknown` names the ones it lacks."""

    def __init__(self, base_url: str, unknown: frozenset[tuple[str, str]] = LATER_REGISTRATION_FIELDS) -> None:
        super().__init__(base_url)
        self.older_model_dims = _older_model_dims(unknown)
        self.registrations: list[dict] = []

    def post(self, path: str, body: bytes, timeout: float) -> Reply:
        if path == "/v1/runs":
            self.registrations.append(json.loads(body))
            try:
                self.older_model_dims.model_validate(json.loads(body).get("model", {}))
            except pydantic.ValidationError as exc:
                errors = [{**e, "loc": ("body", "model", *e["loc"])} for e in exc.errors()]
                answer = asyncio.run(main._validation_error(None, RequestValidationError(errors)))  # type: ignore[arg-type]
                return Reply(answer.status_code, bytes(answer.body))
        return super().post(path, body, timeout)


def test_an_older_collector_that_refuses_the_moe_fields_gets_the_run_registered_without_them(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An agent that derives an MoE's experts (agent/_model_facts.py) must not lose its run to a
    collector one release older: the registration goes again without the fields that collector
    does not know, every batch is stored, and one line says what is missing and the fix."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    transport = OlderCollectorTransport(collector.url)
    config = AgentConfig(collector=collector.url, token="", spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0)
    moe = RunRegistration(run="r1", model={"hidden": 64, "experts": 8, "active_experts": 2})
    reg = without_absent_later_fields(moe.model_dump(mode="json"))  # as attach sends it
    exp = spooling_exporter(config=config, run="r1", rank=0, incarnation=1, registration=reg, transport=transport)
    _emit_steps(exp, range(STEPS))
    exp.shutdown()
    assert _stored(collector.db_url) == ({"r1": "default"}, [(1, s) for s in range(STEPS)])
    assert exp.stats.rejected_batches == 0 and not (tmp_path / "spool" / "r1.rank0.quarantine.jsonl").exists()
    assert [r["model"].get("experts") for r in transport.registrations] == [8, None]  # refused once, then without
    assert transport.registrations[1]["model"]["hidden"] == 64  # only the unknown fields go
    assert _warnings(caplog) == [
        f"trainvitals agent: the collector at {collector.url} is older than this agent: it does not know the "
        "registration field(s) model.experts, model.active_experts, so the run is registered without them (its MFU "
        "prediction takes the model as dense). Upgrade the collector to the agent's version"
    ]


def test_a_dense_model_registers_with_an_older_collector_at_once(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The later fields a model has no value for are not sent as null: a collector older than them
    takes the registration the first time, and nothing is said about fields the model lacks."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    transport = OlderCollectorTransport(collector.url)
    config = AgentConfig(collector=collector.url, token="", spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0)
    dense = RunRegistration(run="r1", model={"hidden": 64, "ffn_hidden": 256}).model_dump(mode="json")
    assert dense["model"]["experts"] is None  # what pydantic dumps, and what the agent leaves out
    exp = spooling_exporter(
        config=config, run="r1", rank=0, incarnation=1, registration=without_absent_later_fields(dense),
        transport=transport,
    )
    _emit_steps(exp, range(STEPS))
    exp.shutdown()
    assert _stored(collector.db_url) == ({"r1": "default"}, [(1, s) for s in range(STEPS)])
    assert len(transport.registrations) == 1 and _warnings(caplog) == []


def _run_through_an_older_collector(
    collector: CollectorServer, tmp_path: Path, model: dict, *, unknown: tuple[str, str]
) -> OlderCollectorTransport:
    """A job registering `model` (as attach sends it) through a collector that lacks one later field;
    every batch stored. The transport, for the registrations it saw."""
    transport = OlderCollectorTransport(collector.url, unknown=frozenset({unknown}))
    config = AgentConfig(collector=collector.url, token="", spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0)
    reg = without_absent_later_fields(RunRegistration(run="r1", model=model).model_dump(mode="json"))
    exp = spooling_exporter(config=config, run="r1", rank=0, incarnation=1, registration=reg, transport=transport)
    _emit_steps(exp, range(STEPS))
    exp.shutdown()
    assert _stored(collector.db_url) == ({"r1": "default"}, [(1, s) for s in range(STEPS)])
    return transport


def test_a_collector_that_knows_the_experts_but_not_the_shared_ones_keeps_the_experts(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A collector of the release before shared_ffn_hidden (session 47) knows experts and top-k:
    only the shared width goes, and the line says what that costs the prediction."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    model = {"hidden": 64, "experts": 8, "active_experts": 2, "shared_ffn_hidden": 256}
    transport = _run_through_an_older_collector(collector, tmp_path, model, unknown=("model", "shared_ffn_hidden"))
    assert [r["model"].get("shared_ffn_hidden") for r in transport.registrations] == [256, None]
    assert transport.registrations[1]["model"]["experts"] == 8
    assert _warnings(caplog) == [
        f"trainvitals agent: the collector at {collector.url} is older than this agent: it does not know the "
        "registration field(s) model.shared_ffn_hidden, so the run is registered without them (its MFU prediction "
        "leaves the MoE's shared experts out). Upgrade the collector to the agent's version"
    ]


def test_a_collector_that_knows_the_shared_experts_but_not_head_dim_keeps_the_rest(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A collector of the release before head_dim (session 48) refuses it alone: a Qwen3-style dense
    model's registration goes again without it, and the line says what that costs the prediction."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    model = {"hidden": 2560, "heads": 32, "kv_heads": 8, "head_dim": 128}
    transport = _run_through_an_older_collector(collector, tmp_path, model, unknown=("model", "head_dim"))
    assert [r["model"].get("head_dim") for r in transport.registrations] == [128, None]
    assert transport.registrations[1]["model"]["heads"] == 32
    assert _warnings(caplog) == [
        f"trainvitals agent: the collector at {collector.url} is older than this agent: it does not know the "
        "registration field(s) model.head_dim, so the run is registered without them (its MFU prediction counts "
        "its attention hidden wide, not heads x head_dim). Upgrade the collector to the agent's version"
    ]


def test_a_collector_that_knows_head_dim_but_not_the_attention_core_width_keeps_the_rest(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A collector of the release before attention_core_width (session 49) refuses it alone: an MLA
    model's registration goes again without it, and the line says what that costs the prediction."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    model = {"hidden": 7168, "heads": 128, "experts": 256, "active_experts": 8, "attention_core_width": 20480}
    transport = _run_through_an_older_collector(collector, tmp_path, model, unknown=("model", "attention_core_width"))
    assert [r["model"].get("attention_core_width") for r in transport.registrations] == [20480, None]
    assert transport.registrations[1]["model"]["experts"] == 256
    assert _warnings(caplog) == [
        f"trainvitals agent: the collector at {collector.url} is older than this agent: it does not know the "
        "registration field(s) model.attention_core_width, so the run is registered without them (its MFU "
        "prediction counts its attention core hidden wide, not as wide as its heads). Upgrade the collector to the "
        "agent's version"
    ]


def test_the_current_collector_stores_the_moe_fields(collector: CollectorServer, tmp_path: Path) -> None:
    config = AgentConfig(collector=collector.url, token="", spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0)
    model = {"experts": 8, "active_experts": 2, "shared_ffn_hidden": 256, "head_dim": 128, "attention_core_width": 512}
    reg = RunRegistration(run="r1", model=model).model_dump(mode="json")
    exp = spooling_exporter(config=config, run="r1", rank=0, incarnation=1, registration=reg)
    _emit_steps(exp, range(2))
    exp.shutdown()
    engine = db.make_engine(collector.db_url)
    with engine.connect() as conn:
        (stored,) = conn.execute(select(Run.registration)).scalars()
    engine.dispose()
    assert {k: stored["model"][k] for k in model} == model


@pytest.mark.parametrize(
    ("detail", "expected"),
    [
        ([{"loc": ["body", "model", "experts"], "type": "extra_forbidden"}], [("model", "experts")]),
        # any other refusal of the registration is the job's to fix: not retried without anything
        ([{"loc": ["body", "model", "expert"], "type": "extra_forbidden"}], []),
        ([{"loc": ["body", "model", "experts"], "type": "extra_forbidden"},
          {"loc": ["body", "model", "hidden"], "type": "greater_than_equal"}], []),
        ([{"loc": ["body", "model", "experts"], "type": "greater_than_equal"}], []),
        ("run id is taken", []),
    ],
)  # fmt: skip
def test_only_a_refusal_of_the_later_fields_alone_is_answered_by_dropping_them(detail: object, expected: list) -> None:
    assert unknown_later_fields(Reply(422, json.dumps({"detail": detail}).encode())) == expected
    assert unknown_later_fields(Reply(409, json.dumps({"detail": detail}).encode())) == []


def test_exit_report_for_an_unreachable_collector(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    exp = _exporter("http://127.0.0.1:9", tmp_path, token="tv_never_printed_anywhere", project=None)
    _emit_steps(exp, range(3))
    exp.shutdown(timeout=0.5)
    spool = tmp_path / "spool" / "r1.rank0.jsonl"
    said = _warnings(caplog)
    assert said[0].startswith("trainvitals agent: cannot reach the collector at http://127.0.0.1:9 (")
    # Retried on the next pass (backoff 0 here, the send interval 2 s): the longer of the two is said.
    assert f"batches wait in {spool} and are retried every 2 s" in said[0]
    assert said[-1].startswith(
        "trainvitals agent: 3 batch(es) were not delivered to the collector at http://127.0.0.1:9; "
        f"they wait in {spool}"
    )
    assert len(said) == 2 and not any("tv_never" in s for s in said)


# --------------------------------------------------------------------------- another job under the same run id


def _job(url: str, tmp_path: Path, hidden: int, *, steps: int, restart_count: int = 0) -> dict[str, int]:
    """One job's rank 0 through attach(): a model of width `hidden` trained for `steps` steps."""
    import torch

    import trainvitals.agent as tv
    from trainvitals.agent import _agent

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(hidden, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    info = _agent.RankInfo(rank=0, world_size=1, hostname="h", restart_count=restart_count)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_agent, "rank_info", lambda: info)
        agent = tv.attach(
            model, opt, run="shared", registration={"model": {"hidden": hidden}},
            config=AgentConfig(collector=url, spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0,
                               send_interval_s=0.05),
        )  # fmt: skip
    assert isinstance(agent, _agent.Agent)
    for _ in range(steps):
        model(torch.randn(2, hidden)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        agent.step(tokens=2)
        time.sleep(0.02)  # several batches, sent while the job runs
    agent.close()
    return agent.stats()


def test_another_job_reusing_a_run_id_is_set_aside_and_told_why(
    collector: CollectorServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    first = _job(collector.url, tmp_path, 8, steps=4)
    assert first["rejected_batches"] == 0 and _warnings(caplog) == []
    runs, steps = _stored(collector.db_url)
    (incarnation,) = {i for i, _ in steps}
    assert runs == {"shared": "default"} and [s for _, s in steps] == [0, 1, 2, 3]

    other = _job(collector.url, tmp_path, 16, steps=6)  # another model, the same run id
    assert other["delivered_batches"] == 0 and other["rejected_batches"] >= 1
    assert _stored(collector.db_url) == (runs, steps)  # none of its steps joined the first job's history
    quarantine = tmp_path / "spool" / "shared.rank0.quarantine.jsonl"
    lines = [json.loads(line) for line in quarantine.read_bytes().splitlines()]
    assert all("records" in line and line["incarnation"] != incarnation for line in lines)  # batches only
    assert sorted(r["step"] for line in lines for r in line["records"] if r["kind"] == "step") == list(range(6))
    said = _warnings(caplog)
    refused = [s for s in said if "refused the run registration (409)" in s]
    assert len(refused) == 1, said  # once, not per batch
    assert (
        f"the collector at {collector.url} refused the run registration (409): run 'shared' is registered for "
        "another job (model.hidden: 8 registered, 16 now): nothing of this process is stored under it. Give this "
        "job its own run id (attach(run=...) or TRAINVITALS_RUN)"
    ) in refused[0]
    # Replay would be refused the same way (the process is fenced): no replay command is offered.
    assert f"Set aside in {quarantine} (kept for the record); later data keeps flowing" in refused[0]
    assert "trainvitals replay" not in refused[0]
    assert said[-1].startswith(f"trainvitals agent: {other['rejected_batches']} batch(es) the collector refused")
    assert said[-1].endswith("To keep this job's data, rerun it under its own run id")
    assert other["failed_attempts"] == 0


def test_a_torchrun_restart_registers_as_a_resume(collector: CollectorServer, tmp_path: Path) -> None:
    """Workers relaunched by torchrun (TORCHELASTIC_RESTART_COUNT > 0) are the same job by
    construction: their registration says resume, so a resize is never refused as another job."""
    _job(collector.url, tmp_path, 8, steps=2)
    relaunched = _job(collector.url, tmp_path, 16, steps=3, restart_count=1)
    assert relaunched["rejected_batches"] == 0
    runs, steps = _stored(collector.db_url)
    assert runs == {"shared": "default"} and len({i for i, _ in steps}) == 2 and len(steps) == 5


def test_a_token_read_with_its_newline_delivers_and_is_never_printed(
    secured: CollectorServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A token from a file or a Kubernetes secret ends in a newline, which no HTTP header holds:
    every delivery failed, and the agent's error line carried the token itself."""
    caplog.set_level(logging.WARNING, "trainvitals.agent")
    token = _token(secured.db_url, "llm")
    monkeypatch.setenv("TRAINVITALS_TOKEN", token + "\n")
    config = AgentConfig(collector=secured.url + "\n", spill_dir=str(tmp_path / "spool"), retry_backoff_s=0.0)
    reg = RunRegistration(run="r1", parallelism={"world_size": 1}).model_dump(mode="json")
    del reg["project"]
    exp = spooling_exporter(config=config, run="r1", rank=0, incarnation=1, registration=reg)
    _emit_steps(exp, range(3))
    exp.shutdown()
    assert exp.stats.delivered_batches == 3 and exp.stats.failed_attempts == 0
    assert _stored(secured.db_url) == ({"llm/r1": "llm"}, [(1, s) for s in range(3)])
    assert not [s for s in _warnings(caplog) if token in s]
    # A space inside the token: attach() refuses it in one line (tests/agent/test_agent.py).
