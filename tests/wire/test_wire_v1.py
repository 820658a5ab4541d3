import json
import math

import pytest
from pydantic import ValidationError

from trainvitals.wire import Batch, RunRegistration


def _batch(**records: object) -> dict:
    return {"run": "r1", "rank": 3, "incarnation": 7, "seq": 0, "records": [records]}


def test_every_record_kind_round_trips_through_json() -> None:
    body = {
        "run": "r1",
        "rank": 0,
        "incarnation": 1,
        "seq": 5,
        "records": [
            {"kind": "step", "step": 1, "ts": 1.0, "step_seconds": 0.5, "loss": float("nan"), "tokens": 10},
            {
                "kind": "tensor",
                "step": 1,
                "tensor": "layers.0.fc",
                "role": "input",
                "format": "e4m3",
                "amax": 3.0,
                "headroom_bits": 2.5,
            },
            {"kind": "grad", "step": 1, "group": "__global__", "owned_sq": float("inf"), "local_sq": 4.0},
            {"kind": "checkpoint", "step": 1, "generation": 0, "status": "persisted", "ts": 2.0, "bytes": 10},
            {"kind": "event", "ts": 3.0, "event": "failure", "domains": {"rack": "r7"}},
        ],
    }
    batch = Batch.model_validate(body)
    again = Batch.model_validate_json(batch.model_dump_json())
    assert [r.kind for r in again.records] == ["step", "tensor", "grad", "checkpoint", "event"]
    assert math.isnan(again.records[0].loss)  # non-finite values are data, not errors
    assert math.isinf(again.records[2].owned_sq)


@pytest.mark.parametrize(
    ("record", "field"),
    [
        ({"kind": "step", "step": -1, "ts": 1.0, "step_seconds": 0.1}, "step"),
        ({"kind": "step", "step": 1, "ts": 1.0, "step_seconds": -0.1}, "step_seconds"),
        ({"kind": "step", "step": 1, "ts": 1.0, "step_seconds": 0.1, "lossx": 1.0}, "lossx"),
        ({"kind": "tensor", "step": 1, "tensor": "a", "role": "bias", "format": "e4m3", "amax": 1.0}, "role"),
        ({"kind": "nope", "step": 1}, "kind"),
    ],
)
def test_invalid_records_name_the_field(record: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        Batch.model_validate(_batch(**record))
    where = [".".join(str(p) for p in e["loc"]) + " " + e["msg"] for e in info.value.errors()]
    assert any(field in w for w in where), where


def test_registration_defaults_and_strictness() -> None:
    reg = RunRegistration(run="r1")
    assert reg.parallelism.world_size == 1 and reg.fp8.history_len == 1024
    with pytest.raises(ValidationError):
        RunRegistration.model_validate({"run": "r1", "parallelism": {"tp": 0}})
    with pytest.raises(ValidationError):
        RunRegistration.model_validate({"run": "has space"})
    assert json.loads(reg.model_dump_json())["run"] == "r1"


def test_a_baseline_run_is_another_run_id() -> None:
    assert RunRegistration(run="r2", baseline_run="r1").baseline_run == "r1"
    for bad, message in (("has space", "pattern"), ("r2", "names the run itself")):
        with pytest.raises(ValidationError, match=message):
            RunRegistration.model_validate({"run": "r2", "baseline_run": bad})
