"""Every numeric field at its extremes, through the real route, on both backends: a value in its
wire range is stored and reads back exactly as sent; one outside it is a 422 naming the field, and
nothing is stored. (PostgreSQL once stored pp_stage = 2**31 as -2**31 and answered 200.)

The ranges are read from the pydantic models (wire/v1.py), so a field added later is covered.
"""

from __future__ import annotations

import itertools
import json
import math
import sys
import types
from typing import Annotated, Any, Union, get_args, get_origin

import annotated_types
import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from pydantic.types import AllowInfNan
from sqlalchemy import select

from trainvitals.service.main import create_app
from trainvitals.service.settings import Settings
from trainvitals.service.store import db
from trainvitals.service.store.models import RECORD_TABLES, DeliveredBatch, Run
from trainvitals.wire import v1
from trainvitals.wire.docs import constraints

FLOAT_MAX = sys.float_info.max
TINY = 5e-324  # the smallest subnormal

BASE: dict[str, dict[str, Any]] = {
    "step": {"kind": "step", "step": 3, "ts": 10.0, "step_seconds": 0.5},
    "tensor": {"kind": "tensor", "step": 3, "tensor": "blocks.0.fc1", "role": "input", "format": "e4m3", "amax": 2.0},
    "grad": {"kind": "grad", "step": 3, "group": "blocks.0", "owned_sq": 1.0, "local_sq": 1.0},
    "checkpoint": {"kind": "checkpoint", "step": 3, "generation": 1, "status": "persisted", "ts": 11.0},
    "event": {"kind": "event", "ts": 12.0, "event": "restart"},
}
MODELS: dict[str, type[BaseModel]] = {
    "step": v1.StepRecord,
    "tensor": v1.TensorRecord,
    "grad": v1.GradRecord,
    "checkpoint": v1.CheckpointRecord,
    "event": v1.EventRecord,
}


def _base_type(tp: Any) -> Any:
    if get_origin(tp) is Annotated:
        return _base_type(get_args(tp)[0])
    if get_origin(tp) in (Union, types.UnionType):
        (member,) = [a for a in get_args(tp) if a is not type(None)]
        return _base_type(member)
    return tp


class Spec:
    """A numeric field's wire range."""

    def __init__(self, model: type[BaseModel], name: str) -> None:
        info = model.model_fields[name]
        self.name = name
        self.type = _base_type(info.annotation)
        self.lo: float | None = None
        self.hi: float | None = None
        self.finite = False
        self.lo_open = False  # gt rather than ge
        for c in constraints(info.annotation, info.metadata):
            if isinstance(c, annotated_types.Ge | annotated_types.Gt):
                self.lo = c.ge if isinstance(c, annotated_types.Ge) else c.gt
                self.lo_open = isinstance(c, annotated_types.Gt)
            elif isinstance(c, annotated_types.Le):
                self.hi = c.le
            elif isinstance(c, AllowInfNan):
                self.finite = not c.allow_inf_nan
            assert not isinstance(c, annotated_types.Lt), "extend the test for an upper bound with lt"

    def extremes(self) -> list[Any]:
        if self.type is int:
            assert self.lo is not None and self.hi is not None, f"{self.name}: an integer without a range"
            return [self.lo, self.lo - 1, self.hi, self.hi + 1, (self.lo + self.hi) // 2, -(2**63) - 1, 2**64]
        values = [FLOAT_MAX, -FLOAT_MAX, TINY, -TINY, 0.0, math.inf, -math.inf, math.nan]
        return values + [float(v) for v in (self.lo, self.hi) if v is not None]

    def accepts(self, value: Any) -> bool:
        if self.type is float and not math.isfinite(value):
            return not self.finite
        above = self.lo is None or (value > self.lo if self.lo_open else value >= self.lo)
        return above and (self.hi is None or value <= self.hi)


def _numeric(model: type[BaseModel]) -> list[Spec]:
    specs = [Spec(model, name) for name in model.model_fields]
    return [s for s in specs if s.type in (int, float)]


RECORD_SPECS = {kind: _numeric(model) for kind, model in MODELS.items()}
# Record fields stored in a column of another name; a checkpoint record about an earlier
# incarnation's save is stored under that incarnation.
COLUMN_OF = {"group": "group_name", "saved_by_incarnation": "incarnation"}
HEADER_SPECS = [s for s in _numeric(v1.Batch) if s.name in ("rank", "incarnation", "seq")]


def test_every_integer_field_has_the_range_of_its_column() -> None:
    """The ranges the property test relies on: int4 columns get 2**31-1, the rest 64 bits (steps 2**53-1)."""
    for kind, specs in RECORD_SPECS.items():
        table = RECORD_TABLES[kind]
        for spec in specs:
            if spec.type is not int:
                continue
            column = table.c[COLUMN_OF.get(spec.name, spec.name)]
            bits = 32 if type(column.type).__name__ == "Integer" else 64
            assert spec.lo == 0 and spec.hi <= 2 ** (bits - 1) - 1, (kind, spec.name)
    assert {s.name: s.hi for s in HEADER_SPECS} == {"rank": 2**31 - 1, "incarnation": 2**63 - 1, "seq": 2**63 - 1}


@st.composite
def _batches(draw: st.DrawFn) -> tuple[dict[str, Any], list[Spec]]:
    """A one-record batch with some numeric fields (record and header) at an extreme; returns the
    body and the fields set out of range."""
    kind = draw(st.sampled_from(sorted(BASE)))
    record = dict(BASE[kind])
    header: dict[str, Any] = {"rank": 1, "incarnation": 2, "seq": 0}
    bad = []
    for target, specs in ((record, RECORD_SPECS[kind]), (header, HEADER_SPECS)):
        for spec in specs:
            if draw(st.booleans()):
                value = draw(st.sampled_from(spec.extremes()))
                target[spec.name] = value
                if not spec.accepts(value):
                    bad.append(spec)
    return {**header, "records": [record]}, bad


@pytest.fixture
def client(db_url: str):
    with TestClient(create_app(Settings(db=db_url, run_analysis=False, auth=False))) as c:
        yield c


def _same(sent: Any, stored: Any) -> bool:
    if isinstance(sent, float) and math.isnan(sent):
        return isinstance(stored, float) and math.isnan(stored)
    return sent == stored and type(stored) is type(sent)


_RUNS = itertools.count()


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=_batches())
def test_extremes_are_stored_exactly_or_refused_naming_the_field(client: TestClient, db_url: str, case) -> None:
    body, bad = case
    run = f"ranges-{next(_RUNS)}"
    assert client.post("/v1/runs", json={"run": run}).status_code == 201
    body["run"] = run
    response = client.post(
        "/v1/batches", content=json.dumps(body).encode(), headers={"content-type": "application/json"}
    )
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            (record,) = body["records"]
            table = RECORD_TABLES[record["kind"]]
            rows = conn.execute(select(table).where(table.c.run_id == run)).mappings().all()
            d = DeliveredBatch
            delivered = conn.execute(select(d.rank, d.incarnation, d.seq).where(d.run_id == run)).all()
    finally:
        engine.dispose()
    if bad:
        assert response.status_code == 422, (response.status_code, response.text, [s.name for s in bad])
        for spec in bad:
            assert spec.name in response.json()["message"], (spec.name, response.text)
        assert rows == [] and delivered == []
        return
    assert response.status_code == 200, response.text
    assert response.json() == {"accepted": 1, "duplicate": False}
    (row,) = rows
    for name, value in record.items():
        if name != "kind":
            assert _same(value, row[COLUMN_OF.get(name, name)]), (name, value, row)
    incarnation = record.get("saved_by_incarnation", body["incarnation"])
    assert (row["rank"], row["incarnation"]) == (body["rank"], incarnation)
    assert [tuple(d) for d in delivered] == [(body["rank"], body["incarnation"], body["seq"])]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_registration_extremes_are_stored_exactly_or_refused_naming_the_field(
    client: TestClient, db_url: str, data: st.DataObject
) -> None:
    """The registration's integers (world_size lands in an int4 column, the rest in JSON)."""
    run = f"reg-{next(_RUNS)}"
    body: dict[str, Any] = {"run": run}
    bad = []
    for section, model in (("model", v1.ModelDims), ("parallelism", v1.Parallelism), ("hardware", v1.Hardware)):
        for spec in _numeric(model):
            if spec.type is int and data.draw(st.booleans()):
                value = data.draw(st.sampled_from(spec.extremes()))
                body.setdefault(section, {})[spec.name] = value
                if not spec.accepts(value):
                    bad.append(spec)
    response = client.post("/v1/runs", json=body)
    engine = db.make_engine(db_url)
    try:
        with engine.connect() as conn:
            stored = conn.execute(select(Run.world_size, Run.registration).where(Run.run_id == run)).first()
    finally:
        engine.dispose()
    if bad:
        assert response.status_code == 422, response.text
        for spec in bad:
            assert spec.name in response.text, (spec.name, response.text)
        assert stored is None
        return
    assert response.status_code == 201, response.text
    assert stored is not None
    assert stored.world_size == body.get("parallelism", {}).get("world_size", 1)
    for section in ("model", "parallelism", "hardware"):
        for name, value in body.get(section, {}).items():
            assert stored.registration[section][name] == value, (section, name)
