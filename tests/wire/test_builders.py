"""The record builders follow the pydantic models: same fields, same required set, valid output.

A field added to a model in wire/v1.py without its builder (or the other way round) fails here.
"""

import inspect
import math
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from trainvitals.wire import (
    WIRE_VERSION,
    Batch,
    CheckpointRecord,
    EventRecord,
    GradRecord,
    StepRecord,
    TensorRecord,
    batch_header,
    checkpoint_record,
    event_record,
    grad_record,
    step_record,
    tensor_record,
)

BUILDERS: list[tuple[type[BaseModel], Callable[..., dict[str, Any]]]] = [
    (StepRecord, step_record),
    (TensorRecord, tensor_record),
    (GradRecord, grad_record),
    (CheckpointRecord, checkpoint_record),
    (EventRecord, event_record),
]

# Fields the builder sets itself rather than taking them as arguments.
SET_BY_BUILDER = {StepRecord: {"kind"}, TensorRecord: {"kind"}, GradRecord: {"kind"},
                  CheckpointRecord: {"kind"}, EventRecord: {"kind"}, Batch: {"wire_version", "records"}}  # fmt: skip

# A valid value for every field of every model: the "every field given" case below. Keyed by
# model so that a new field without a value here fails test_every_field_has_a_sample_value.
EVERY_FIELD: dict[type[BaseModel], dict[str, Any]] = {
    StepRecord: {
        "step": 3, "ts": 1.5, "step_seconds": 0.4, "compute_seconds": 0.3, "wait_seconds": 0.05,
        "data_seconds": 0.05, "loss": 2.5, "tokens": 4096, "flops": 1e12, "lr": 3e-4, "grad_norm": 1.2,
        "pp_stage": 1, "tp_rank": 0, "dp_rank": 2, "skipped": True,
    },
    TensorRecord: {
        "step": 3, "tensor": "layers.0.fc", "role": "grad_output", "format": "e5m2", "amax": 3.0,
        "scale": 2.0, "headroom_bits": 1.5, "lag_bits": 0.1, "staleness_steps": 4, "sat_frac": 0.0,
        "underflow_frac": 0.25, "crest_bits": 6.0, "nonfinite": 0, "shadow": True,
    },
    GradRecord: {"step": 3, "group": "layers.0", "owned_sq": 4.0, "local_sq": 4.0, "nonfinite": 1},
    CheckpointRecord: {
        "step": 3, "generation": 3, "status": "persisted", "ts": 2.0, "path": "/ck/3", "bytes": 10,
        "stall_seconds": 0.5, "persist_seconds": 1.0, "checksum": "sha256:00", "error": "none",
        "saved_by_incarnation": 1,
    },
    EventRecord: {"ts": 1.0, "step": 3, "event": "failure", "detail": "gpu 3", "domains": {"rack": "r7"}},
    Batch: {"run": "r1", "rank": 2, "incarnation": 7, "seq": 0, "sent_at": 5.0},
}  # fmt: skip

ALL = [*BUILDERS, (Batch, batch_header)]


def _expected_default(field: Any) -> Any:
    # A default_factory (e.g. EventRecord.domains) becomes None: "not given", the factory's value.
    return None if field.default is PydanticUndefined else field.default


@pytest.mark.parametrize(("model", "build"), ALL, ids=lambda x: getattr(x, "__name__", ""))
def test_builder_signature_is_the_models_fields(model: type[BaseModel], build: Callable[..., Any]) -> None:
    params = inspect.signature(build).parameters
    fields = {n: f for n, f in model.model_fields.items() if n not in SET_BY_BUILDER[model]}
    assert set(params) == set(fields), "builder and model disagree on the field names"
    for name, field in fields.items():
        param = params[name]
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, name
        assert param.annotation is not inspect.Parameter.empty, f"{name} is not annotated"
        if field.is_required():
            assert param.default is inspect.Parameter.empty, f"{name} is required by the model"
        else:
            assert param.default == _expected_default(field), f"{name}: default differs from the model's"
    assert inspect.signature(build).return_annotation is not inspect.Signature.empty


@pytest.mark.parametrize("model", list(EVERY_FIELD), ids=lambda m: m.__name__)
def test_every_field_has_a_sample_value(model: type[BaseModel]) -> None:
    assert set(EVERY_FIELD[model]) == set(model.model_fields) - SET_BY_BUILDER[model]


@pytest.mark.parametrize(("model", "build"), BUILDERS, ids=lambda x: getattr(x, "__name__", ""))
def test_builder_output_validates_and_keeps_every_value(model: type[BaseModel], build: Callable[..., Any]) -> None:
    full = build(**EVERY_FIELD[model])
    parsed = model.model_validate(full)
    assert parsed.model_dump() == full
    required = {n: v for n, v in EVERY_FIELD[model].items() if model.model_fields[n].is_required()}
    minimal = build(**required)
    # Optional fields that are None are left out; the model fills in the same defaults.
    assert set(minimal) <= set(full) and all(v is not None for v in minimal.values())
    assert model.model_validate(minimal).model_dump(exclude_unset=True) == minimal


def test_optional_none_is_left_out_not_sent_as_null() -> None:
    rec = step_record(step=0, ts=1.0, step_seconds=0.1, loss=None, tokens=0, lr=None)
    assert rec == {"kind": "step", "step": 0, "ts": 1.0, "step_seconds": 0.1, "tokens": 0}
    assert "domains" not in event_record(ts=1.0, event="note", domains={})


def test_non_finite_values_pass_through() -> None:
    rec = grad_record(step=1, group="__global__", owned_sq=math.inf, local_sq=math.nan)
    parsed = GradRecord.model_validate(rec)
    assert math.isinf(parsed.owned_sq) and math.isnan(parsed.local_sq)


def test_batch_header_plus_records_is_a_batch() -> None:
    head = batch_header(**EVERY_FIELD[Batch])
    assert head["wire_version"] == WIRE_VERSION
    records = [build(**EVERY_FIELD[model]) for model, build in BUILDERS]
    batch = Batch.model_validate({**head, "records": records})
    assert [r.kind for r in batch.records] == ["step", "tensor", "grad", "checkpoint", "event"]
    assert "sent_at" not in batch_header(run="r1", rank=0, incarnation=1, seq=0)


def test_wire_imports_with_pydantic_only() -> None:
    code = (
        "import sys, trainvitals.wire; "
        "bad = [m for m in ('torch', 'msgspec', 'fastapi', 'sqlalchemy') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
