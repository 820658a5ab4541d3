"""The msgspec fast decoder (service/decode.py) agrees with the pydantic wire models.

The pydantic models are the contract; the fast path may refuse more (the route then asks pydantic,
which accepts or writes the 422), but it must never accept a batch pydantic refuses, nor read a
value differently.
"""

import json
import random
from typing import Any

import msgspec
import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from trainvitals.service.api.routes.ingest import decode_body
from trainvitals.service.ingest import decode
from trainvitals.testing.scenarios import Layout, make_scenario, to_wire_lines
from trainvitals.wire import v1

PAIRS = [
    (v1.StepRecord, decode.StepRecord),
    (v1.TensorRecord, decode.TensorRecord),
    (v1.GradRecord, decode.GradRecord),
    (v1.CheckpointRecord, decode.CheckpointRecord),
    (v1.EventRecord, decode.EventRecord),
    (v1.Batch, decode.Batch),
]


def _fast_record_dict(record: Any) -> dict[str, Any]:
    return {"kind": record.kind, **msgspec.structs.asdict(record)}


def _same(pyd: v1.Batch, fast: decode.Batch) -> None:
    assert (pyd.run, pyd.rank, pyd.incarnation, pyd.seq, pyd.sent_at) == (
        fast.run,
        fast.rank,
        fast.incarnation,
        fast.seq,
        fast.sent_at,
    )
    assert [r.model_dump() for r in pyd.records] == [_fast_record_dict(r) for r in fast.records]


@pytest.mark.parametrize(("model", "struct"), PAIRS, ids=lambda x: getattr(x, "__name__", ""))
def test_same_fields_and_defaults(model, struct) -> None:
    fields = {n: f for n, f in model.model_fields.items() if n != "kind"}
    assert set(fields) == set(struct.__struct_fields__)
    with_default = struct.__struct_fields__[len(struct.__struct_fields__) - len(struct.__struct_defaults__) :]
    defaults = dict(zip(with_default, struct.__struct_defaults__, strict=True))
    for name, field in fields.items():
        if field.is_required():
            assert name not in defaults, name
        else:
            fast_default = defaults[name]
            if isinstance(fast_default, msgspec._core.Factory):  # msgspec wraps mutable defaults
                fast_default = fast_default.factory()
            assert fast_default == field.get_default(call_default_factory=True), name


def test_scenario_streams_decode_identically() -> None:
    """Every batch of two synthetic runs (FP8 stats, gradients, checkpoints, events)."""
    n = 0
    for family in ("fp8_jump", "healthy_resume"):
        lines = to_wire_lines(make_scenario(family, 0, layout=Layout(dp=1, layers=2, groups=2)), steps_per_batch=500)
        for line in lines:
            body = line.encode()
            if b'"records"' not in body:
                continue
            _same(v1.Batch.model_validate_json(body), decode.decode_batch(body))
            n += 1
    assert n > 10


BASE = {
    "run": "r1",
    "rank": 3,
    "incarnation": 1,
    "seq": 0,
    "records": [
        {"kind": "step", "step": 5, "ts": 1.5, "step_seconds": 0.2, "loss": 2.1, "tokens": 512},
        {
            "kind": "tensor",
            "step": 5,
            "tensor": "blocks.0.fc1",
            "role": "input",
            "format": "e4m3",
            "amax": 3.0,
            "sat_frac": 0.0,
        },
        {"kind": "grad", "step": 5, "group": "blocks.0", "owned_sq": 1.0, "local_sq": 2.0},
        {"kind": "checkpoint", "step": 5, "generation": 1, "status": "persisted", "ts": 2.0, "bytes": 10},
        {"kind": "event", "ts": 3.0, "event": "failure", "domains": {"node": "n1"}},
    ],
}

# Values a fuzzer drops into fields: wrong types, bounds, lax forms only pydantic accepts.
POOL: list[Any] = [
    None, True, False, 0, 1, -1, 2, 2**31, 2**63, 2**64 + 1, 0.0, 0.5, 1.0, 1.5, -0.5, 1e308, 3, "",
    "x", "1.5", "3", "e4m3", "e5m2", "input", "weight", "grad_output", "persisted", "stop", "step",
    "tensor", "a" * 257, "r1\n", "r 1", "a\x00b", [], {}, {"k": "v"}, {"k": 1}, [1.0],
]  # fmt: skip


def _mutations(rng: random.Random, n: int) -> list[dict[str, Any]]:
    out = []
    for _ in range(n):
        body = json.loads(json.dumps(BASE))
        for _ in range(rng.randint(1, 3)):
            records = body.get("records")
            dicts = [r for r in records if isinstance(r, dict)] if isinstance(records, list) else []
            obj = rng.choice(dicts) if dicts and rng.random() < 0.8 else body
            action = rng.random()
            key = rng.choice([*obj.keys(), "extra", "kind"])
            if action < 0.8:
                obj[key] = rng.choice(POOL)
            elif key in obj:
                del obj[key]
        out.append(body)
    return out


def test_fuzzed_batches_never_accepted_by_the_fast_path_alone() -> None:
    """4,000 mutated batches: whatever msgspec accepts, pydantic accepts with the same values."""
    rng = random.Random(20261122)
    accepted = refused_by_both = lax_only = 0
    for body in _mutations(rng, 4000):
        raw = json.dumps(body).encode()
        try:
            fast = decode.decode_batch(raw)
        except (msgspec.ValidationError, msgspec.DecodeError):
            fast = None
        try:
            pyd = v1.Batch.model_validate_json(raw)
        except ValidationError:
            pyd = None
        if fast is not None:
            assert pyd is not None, raw
            _same(pyd, fast)
            accepted += 1
        elif pyd is None:
            refused_by_both += 1
        else:
            lax_only += 1
    # the mix exercised all three outcomes, refusals most
    assert accepted > 100 and refused_by_both > 1000 and lax_only > 10


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("run",), "r1\n"),  # Python's $ would accept a trailing newline; pydantic does not
        (("run",), "r 1"),  # a body without a backslash: the run id's pattern is still checked
        (("records", 1, "tensor"), "blocks.0\x00.fc1"),  # a NUL, which json.dumps writes as \u0000
        (("records", 2, "group"), "\x00"),
        (("records", 0, "step"), -1),
        (("records", 1, "role"), "output"),
        (("records", 1, "sat_frac"), 1.5),
        (("records", 2, "group"), ""),
        (("records", 4, "domains"), {f"k{i}": "v" for i in range(17)}),
        (("records", 0, "unknown_field"), 1),
    ],
)
def test_refused_by_both(path, value) -> None:
    body = json.loads(json.dumps(BASE))
    obj = body
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value
    raw = json.dumps(body).encode()
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        decode.decode_batch(raw)
    with pytest.raises(RequestValidationError):
        decode_body(raw)  # the route's path: pydantic's 422, which names the field


def test_lax_forms_fall_back_to_pydantic() -> None:
    """NaN constants (a diverged loss) and numbers sent as strings: msgspec refuses, the route
    still takes them through pydantic, so no sender sees a new 422."""
    raw = json.dumps(BASE).replace('"loss": 2.1', '"loss": NaN').replace('"amax": 3.0', '"amax": "3.0"').encode()
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)):
        decode.decode_batch(raw)
    batch = decode_body(raw)
    assert isinstance(batch, v1.Batch)
    assert batch.records[0].loss != batch.records[0].loss  # NaN
    assert batch.records[1].amax == 3.0


def test_the_common_batch_takes_the_fast_path() -> None:
    assert isinstance(decode_body(json.dumps(BASE).encode()), decode.Batch)


def test_names_are_checked_for_nul_only_in_bodies_with_an_escape() -> None:
    """A body without a backslash cannot hold a NUL, and skips the names' pattern (Python's `re`,
    once a name: more than half the decoding); one with an escape anywhere is checked in full, and
    both read the same values."""
    plain = json.dumps(BASE).encode()
    escaped = json.dumps({**BASE, "records": [*BASE["records"][:4], {**BASE["records"][4], "detail": 'a "b"'}]})
    assert b"\\" not in plain and b"\\" in escaped.encode()
    fast, checked = decode.decode_batch(plain), decode.decode_batch(escaped.encode())
    assert type(fast) is not decode.Batch and isinstance(fast, decode.Batch)
    assert type(checked) is decode.Batch
    assert [_fast_record_dict(r) for r in fast.records[:4]] == [_fast_record_dict(r) for r in checked.records[:4]]
    assert fast.records[1].tensor == "blocks.0.fc1" and checked.records[4].detail == 'a "b"'
    assert type(fast.records[1]).__struct_fields__ == decode.TensorRecord.__struct_fields__
    with pytest.raises(msgspec.DecodeError):  # a raw NUL is malformed JSON, on the unchecked path too
        decode.decode_batch(plain.replace(b"blocks.0.fc1", b"blocks.0\x00.fc1"))
