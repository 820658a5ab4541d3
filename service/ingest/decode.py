"""The ingest fast path's decoder: msgspec structs derived from the pydantic wire models.

pydantic's `Batch.model_validate_json` was a quarter of the collector's CPU under load (a model
object per record); msgspec decodes and validates the same JSON into slotted structs several times
faster. The structs are not written by hand: they are built at import from wire/v1.py's models
(field names, types, Literal values, bounds, defaults), so the wire schema exists once. The
pydantic models stay the contract (docs, OpenAPI); whenever msgspec refuses a body, the route
re-validates it with pydantic so the 422 names the field in the usual words.
tests/service/ingest/test_decode.py holds the two to the same verdicts and values.

The structs quack like the pydantic records where ingest reads them: same attribute names, and a
class attribute `kind`.

A name's no-NUL pattern (wire/v1.py `NO_NUL_PATTERN`) is checked by msgspec through Python's `re`,
one call per tensor and gradient record: more than half of decoding the benchmark's batch (157 us
against 72 without it; docs/performance.md, session 58). JSON can only carry a NUL inside a string
as the escape `\\u0000` (a raw control character is malformed JSON, which msgspec refuses), so a
body without a backslash holds none: it is decoded by subclasses of the structs that leave that one
pattern out. Any other body takes the structs as derived, every pattern checked.
"""

from __future__ import annotations

import sys
import types
import typing
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import msgspec
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic.types import AllowInfNan

from trainvitals.wire import v1

# annotated_types constraint -> msgspec.Meta keyword
_BOUNDS = {
    annotated_types.Ge: "ge",
    annotated_types.Gt: "gt",
    annotated_types.Le: "le",
    annotated_types.Lt: "lt",
    annotated_types.MinLen: "min_length",
    annotated_types.MaxLen: "max_length",
}


def _meta(constraints: list[Any], unchecked: frozenset[str]) -> dict[str, Any]:
    """msgspec.Meta keywords of the constraints, less the patterns in `unchecked`."""
    out: dict[str, Any] = {}
    finite = False
    for c in constraints:
        if isinstance(c, FieldInfo):
            out.update(_meta(c.metadata, unchecked))
            continue
        if isinstance(c, AllowInfNan):
            finite = not c.allow_inf_nan
            continue
        for kind, key in _BOUNDS.items():
            if isinstance(c, kind):
                out[key] = getattr(c, key)
        pattern = getattr(c, "pattern", None)
        if pattern is not None and pattern not in unchecked:
            # Python's $ also matches before a trailing newline, pydantic's (Rust) regex does not.
            out["pattern"] = pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern
    if finite:
        # msgspec has no "finite" constraint, but bounds at the largest float refuse Infinity and NaN
        # (which compares false with any bound). JSON bodies never decode to them anyway; the lax
        # conversion of a large body (json.loads, then msgspec.convert) does.
        if "lt" not in out:
            out["le"] = min(out.get("le", _FLOAT_MAX), _FLOAT_MAX)
        if "gt" not in out:
            out["ge"] = max(out.get("ge", -_FLOAT_MAX), -_FLOAT_MAX)
    return out


_FLOAT_MAX = sys.float_info.max


def _is_none(tp: Any) -> bool:
    return tp is type(None)


def _convert(tp: Any, constraints: list[Any], structs: dict[type[BaseModel], type], unchecked: frozenset[str]) -> Any:
    """A pydantic annotation (+ field-level constraints) as a msgspec annotation.

    Constraints go onto the non-None member: pydantic applies `int | None` with ge=0 to the int."""
    if _is_none(tp):
        return tp
    origin = get_origin(tp)
    if origin is Annotated:
        inner, *extra = get_args(tp)
        return _convert(inner, [*constraints, *extra], structs, unchecked)
    if origin in (Union, types.UnionType):
        members = [_convert(a, [] if _is_none(a) else constraints, structs, unchecked) for a in get_args(tp)]
        return typing.Union[tuple(members)]  # noqa: UP007 - built at runtime from a list
    if origin is list:
        (item,) = get_args(tp)
        converted: Any = list[_convert(item, [], structs, unchecked)]  # type: ignore[misc]
    elif origin is dict:
        key, value = get_args(tp)
        converted = dict[  # type: ignore[misc]
            _convert(key, [], structs, unchecked), _convert(value, [], structs, unchecked)
        ]
    elif origin is Literal or tp in (int, float, str, bool):
        converted = tp
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        converted = structs[tp]
    else:
        raise TypeError(f"no msgspec form for wire annotation {tp!r}")
    meta = _meta(constraints, unchecked)
    return Annotated[converted, msgspec.Meta(**meta)] if meta else converted


def _struct(
    model: type[BaseModel], structs: dict[type[BaseModel], type], unchecked: frozenset[str], base: type | None
) -> type:
    """One frozen struct with the model's fields; records are tagged by their `kind`. base: the
    struct it subclasses (the checked one, for the structs that leave patterns unchecked)."""
    kind_field = model.model_fields.get("kind")
    kind = kind_field.default if kind_field is not None else None
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    optional: list[tuple[str, Any, Any]] = []
    for name, info in model.model_fields.items():
        if name == "kind":
            continue
        tp = _convert(info.annotation, list(info.metadata), structs, unchecked)
        if info.is_required():
            fields.append((name, tp))
        elif info.default_factory is not None:
            optional.append((name, tp, msgspec.field(default_factory=info.default_factory)))  # type: ignore[arg-type]
        else:
            optional.append((name, tp, info.default))
    return msgspec.defstruct(
        model.__name__,
        [*fields, *optional],  # msgspec wants the required fields first
        module=__name__,
        bases=(base,) if base is not None else None,
        namespace={"kind": kind} if kind else None,
        tag=kind if kind else None,
        tag_field="kind" if kind else None,
        forbid_unknown_fields=True,
        frozen=True,
    )


_MODELS = (v1.StepRecord, v1.TensorRecord, v1.GradRecord, v1.CheckpointRecord, v1.EventRecord, v1.Batch)


def _derive(
    unchecked: frozenset[str] = frozenset(), bases: dict[type[BaseModel], type] | None = None
) -> dict[type[BaseModel], type]:
    structs: dict[type[BaseModel], type] = {}
    for model in _MODELS:
        structs[model] = _struct(model, structs, unchecked, bases[model] if bases else None)
    return structs


_STRUCTS = _derive()
# Subclasses: isinstance holds, and store/batches.py reads their rows as the checked structs'.
_NAMES_UNCHECKED = _derive(frozenset({v1.NO_NUL_PATTERN}), bases=_STRUCTS)
StepRecord: Any = _STRUCTS[v1.StepRecord]
TensorRecord: Any = _STRUCTS[v1.TensorRecord]
GradRecord: Any = _STRUCTS[v1.GradRecord]
CheckpointRecord: Any = _STRUCTS[v1.CheckpointRecord]
EventRecord: Any = _STRUCTS[v1.EventRecord]
Batch: Any = _STRUCTS[v1.Batch]

_DECODER = msgspec.json.Decoder(Batch)
_NO_ESCAPES_DECODER: msgspec.json.Decoder[Any] = msgspec.json.Decoder(_NAMES_UNCHECKED[v1.Batch])


def decode_batch(body: bytes) -> Any:
    """Decode and validate one batch body into a `Batch` struct; raises msgspec.ValidationError /
    DecodeError for anything the fast path does not take (the route then asks pydantic). A body
    with no backslash cannot hold a NUL (the module docstring): its names' pattern is not checked."""
    return (_DECODER if b"\\" in body else _NO_ESCAPES_DECODER).decode(body)
