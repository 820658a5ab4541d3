"""The HTTP contract: response models in step with what the store and the advisors return, request
models in step with what the advisors take, and every read route documented in /openapi.json."""

import dataclasses
from pathlib import Path

from fastapi.testclient import TestClient
from pydantic import BaseModel

from trainvitals.service import advisors
from trainvitals.service.advisors.cadence import CadenceInputs, TierSpec
from trainvitals.service.advisors.model_config import (
    HARDWARE_ALIASES,
    HARDWARE_KEYS,
    MODEL_ALIASES,
    MODEL_KEYS,
    PARALLELISM_KEYS,
)
from trainvitals.service.advisors.recommend import recommend_from_config
from trainvitals.service.api import schemas
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store.models import FindingRow, TensorSummary
from trainvitals.service.store.queries import RunOverview

PLAN = {
    "model": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 128256, "seq_len": 4096},
    "parallelism": {"gpus": 8, "tp": 2},
    "hardware": {"gpu": "H200", "gpus_per_node": 4},
}


def _fields(model: type[BaseModel]) -> list[str]:
    return list(model.model_fields)


def _columns(table_model: type, *, exclude: tuple[str, ...]) -> list[str]:
    return [c.key for c in table_model.__table__.columns if c.key not in exclude]


def test_read_models_follow_the_stores_rows_in_order() -> None:
    """Field order is the CSV column order: it must be the order the queries produce."""
    assert _fields(schemas.RunOverviewPublic) == [f.name for f in dataclasses.fields(RunOverview)]
    assert _fields(schemas.TensorStepPublic) == _columns(TensorSummary, exclude=("run_id",))
    assert _fields(schemas.FindingPublic) == _columns(FindingRow, exclude=("id", "run_id"))
    assert _fields(schemas.AnalysisFindingPublic) == [f.name for f in dataclasses.fields(Finding) if f.name != "run"]


def test_advisor_models_follow_as_dict() -> None:
    cadence = advisors.advise_cadence(
        CadenceInputs(stall_s=60, mtbf_s=4 * 3600, sdc_latency_s=3600,
                      tiers=(TierSpec(name="ram", cost_s=5, survives="node"),))
    ).as_dict()
    plan = advisors.plan(advisors.parse_plan_input(PLAN)).as_dict()
    rec = recommend_from_config(PLAN).as_dict()
    pairs = [
        (schemas.CadenceAdvicePublic, cadence),
        (schemas.RetentionPublic, cadence["retention"]),
        (schemas.TierAdvicePublic, cadence["tiers"][0]),
        (schemas.PlanPublic, plan),
        (schemas.MemoryPublic, plan["memory"]),
        (schemas.StepTimePublic, plan["step_time"]),
        (schemas.MfuPublic, plan["mfu"]),
        (schemas.RecommendationPublic, rec),
        (schemas.ParallelismPublic, rec["config"]),
        (schemas.LadderStepPublic, rec["ladder"][0]),
    ]
    for model, data in pairs:
        assert _fields(model) == list(data), model.__name__
        assert model.model_validate(data).model_dump(mode="json") == data, model.__name__
    run_advice = schemas.RunCadenceAdvicePublic
    assert _fields(run_advice) == ["run", "observed_saves", "observed_failures", *cadence]


def test_request_models_take_what_the_advisors_take() -> None:
    assert set(_fields(schemas.ModelSection)) == MODEL_KEYS
    assert set(_fields(schemas.ParallelismSection)) == PARALLELISM_KEYS
    assert set(_fields(schemas.HardwareSection)) == HARDWARE_KEYS
    # Every field of the cadence advisor but the event log, with the same defaults.
    inputs = {f.name: f for f in dataclasses.fields(CadenceInputs) if f.name != "log"}
    assert set(_fields(schemas.CadenceRequest)) == set(inputs)
    for name, field in schemas.CadenceRequest.model_fields.items():
        if field.is_required():
            assert inputs[name].default is dataclasses.MISSING, name
        elif name != "tiers":
            assert field.default == inputs[name].default, name
    assert set(_fields(schemas.TierRequest)) == {f.name for f in dataclasses.fields(TierSpec)}


def test_aliases_become_keys_and_values_pass_through_unchanged() -> None:
    alias = next(a for a, key in MODEL_ALIASES.items() if key == "layers")
    hw_alias = next(a for a, key in HARDWARE_ALIASES.items() if key == "gpu")
    body = schemas.PlanRequest.model_validate({
        "model": {**{k: v for k, v in PLAN["model"].items() if k != "layers"}, alias: 32.0},
        "parallelism": {"world_size": 4, "gpus": 8, "zero": "FSDP"},  # two names: the later one wins
        "hardware": {hw_alias: "H200"},
    }).as_config()
    assert body["model"]["layers"] == 32.0 and isinstance(body["model"]["layers"], float)  # the parser checks it
    assert body["parallelism"] == {"gpus": 8, "zero": "FSDP"}
    assert body["hardware"] == {"gpu": "H200"}
    inputs = schemas.CadenceRequest.model_validate({"stall_s": 60, "mtbf_s": 14400.5}).as_inputs()
    assert (inputs.stall_s, inputs.mtbf_s, inputs.restart_s) == (60, 14400.5, 600.0)
    assert isinstance(inputs.stall_s, int)


def test_openapi_documents_every_read_route(tmp_path: Path) -> None:
    app = create_app(Settings(db=f"sqlite:///{tmp_path / 'tv.db'}", auth=False, run_analysis=False, api_docs=True))
    with TestClient(app) as client:
        spec = client.get("/openapi.json").json()
    gets = {path: ops["get"] for path, ops in spec["paths"].items() if path.startswith("/v1") and "get" in ops}
    assert len(gets) == 10
    for path, op in gets.items():
        content = op["responses"]["200"]["content"]
        schema = content["application/json"]["schema"]
        assert "$ref" in schema or "$ref" in schema.get("items", {}), path
        if path.startswith("/v1/runs") and "advice" not in path:
            assert "text/csv" in content, path
    for path in ("/v1/plan", "/v1/plan/recommend", "/v1/advise/checkpoints"):
        op = spec["paths"][path]["post"]
        assert "$ref" in op["requestBody"]["content"]["application/json"]["schema"], path
        assert "$ref" in op["responses"]["200"]["content"]["application/json"]["schema"], path
    models = spec["components"]["schemas"]
    assert models["RunOverviewPublic"]["properties"]["ranks"]["description"] == "Most ranks that reported one step."
    assert models["ModelSection"]["properties"]["layers"]["type"] == "integer"
