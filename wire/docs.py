"""Render the wire-format models as Markdown tables (docs/wire-format.md is generated from this
and a test keeps the two in sync)."""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic.types import AllowInfNan

from trainvitals.wire import v1

_MODELS: list[type[BaseModel]] = [
    v1.RunRegistration,
    v1.ModelDims,
    v1.Parallelism,
    v1.Hardware,
    v1.Fp8Recipe,
    v1.CheckpointSettings,
    v1.Batch,
    v1.StepRecord,
    v1.TensorRecord,
    v1.GradRecord,
    v1.CheckpointRecord,
    v1.EventRecord,
    v1.BatchAck,
]

_HEADER = """# Wire format v1

Generated from `wire/v1.py` by `python -m trainvitals.wire.docs > docs/wire-format.md`.

The agent POSTs a `RunRegistration` to `/v1/runs` (once per rank; idempotent), then `Batch`es to
`/v1/batches`. A batch is identified by (run, rank, incarnation, seq): the collector stores it in
one transaction or not at all, and acknowledges a repeat without storing it again. Unknown fields
are rejected (422 naming the field), so a typo cannot silently drop data. Non-finite floats travel
as the JSON constants `NaN` / `Infinity`. `trainvitals replay FILE` ingests the same messages as
JSON lines (an agent spool file or `record_file` is such a file).

Units: seconds (`*_seconds`, `ts` as Unix epoch seconds), bytes, bits (`*_bits`, log2 ratios),
FLOPs, tokens.

## Ranges

Every field is checked before anything is stored, and a value outside its range is refused with a
422 naming the field (`values` column below): no value is stored changed. Integers have the range
of the column they land in: 0 .. 2^31-1 for ranks, pipeline/TP/DP positions, staleness, checkpoint
generations, world size and the other degrees; 0 .. 2^63-1 for incarnations, `seq`, tokens, bytes
and non-finite counts; steps 0 .. 2^53-1 (exact in a float64, which the detectors' series use).
Times, durations and FLOPs must be finite: they are summed, averaged and written to JSON columns.
A non-finite loss, gradient norm, sum of squares, amax or headroom is accepted: it is what the
detectors report (`nonfinite` counts are summed over ranks, saturating at 2^63-1).

## Delivery: what `seq` guarantees

An agent numbers its batches per (run, rank, incarnation) from 0 without gaps, and resends a batch
until it is acknowledged. The collector uses `seq` only to store each batch once: a batch whose
(run, rank, incarnation, seq) is already stored is acknowledged with `duplicate: true` and nothing
is stored again, however long after the first delivery it comes (a spool replayed after a restart
of the collector or of the rank). It does not wait for, or ask for, a missing `seq`: batches are
stored in the order they arrive, gaps and reordering included (a spool replays its oldest batches
after newer ones were sent live), and records are ordered by `step`, never by `seq`. A `seq`
never delivered is records the collector never saw; steps that some rank did not send are reduced
once the other ranks have sent them and the settle time has passed, with the ranks that did.
A batch is stored whole or not at all; the acknowledgement comes after the commit that holds it.

## Fields added to v1 later

`ModelDims.experts` and `ModelDims.active_experts` (an MoE's E experts per layer and top-k, which
its MFU prediction needs) came after v1 shipped: optional, so an older agent's messages are still
valid. `ModelDims.shared_ffn_hidden` (the width of an MoE's shared experts, which every token passes
through), `ModelDims.head_dim` (one attention head's width, where heads x head_dim is not hidden) and
`ModelDims.attention_core_width` (the attention core's width where its heads are not as wide as its
projections: MLA) came later again, in the same way. A collector older than any of them refuses
them as unknown (422 naming `model.experts`, `model.shared_ffn_hidden`, `model.head_dim` or
`model.attention_core_width`); the agent then registers
again without them and says so once (docs/agent.md, "When the collector refuses"), so upgrade
collectors before agents.

## Run ids

A run id names one job. Registering an id the collector already holds is one of two things:

- **A relaunch of the same job** (a crash, a requeue, torchrun restarting it, the same script run
  again): the project agrees and so does every identity field the registration sends,
  `model.hidden` / `heads` / `kv_heads` / `ffn_hidden` / `vocab` / `experts` / `active_experts` /
  `shared_ffn_hidden` / `head_dim` / `attention_core_width` and
  `parallelism.world_size` / `tp` / `pp` / `cp` / `ep` (a field absent or null on either side
  contradicts nothing). Accepted
  (200) as a restart: the process is a new incarnation, and where it sends steps the run already
  has, the newest incarnation's rows are the history from then on. Batch sizes, sequence length,
  recompute, ZeRO stage, the FP8 recipe, checkpoint settings and tags may change. Layers and
  parameter counts are not compared: an agent that counts its own module sees them per pipeline
  stage or shard, and every rank of one job must pass.
- **Another job reusing the id** (a different model, or a different size of job that derived the
  same default run id from MASTER_ADDR-MASTER_PORT): any identity field differs. Refused with 409,
  naming each difference and the fix: "run 'R' is registered for another job (model.hidden: 768
  registered, 256 now; parallelism.world_size: 1 registered, 2 now): nothing of this
  process is stored under it. Give this job its own run id (attach(run=...) or TRAINVITALS_RUN); if
  it continues that run on a new model or layout, register it with resume=true
  (attach(registration={'resume': True}))". When the registration names its `incarnation`, every
  batch of that incarnation is refused too (409, the same words), so none of its steps land in the
  other job's history; a registration without it can only be refused itself.

`resume: true` declares a continuation on another model or layout (an elastic resize): accepted,
and the run is described by that registration (world size included) from then on. A different
project is always refused (409). Time is not part of the rule: a job's agent sends `stop` at exit
whether the job completed, crashed or was requeued, so "finished" cannot tell a rerun from a
relaunch. So the same script run again, unchanged, under the same id, continues that run's
history; give every experiment its own run id.
"""


def _type_name(tp: Any) -> str:
    """The annotation as a reader writes it: constraints (the `values` column) left out."""
    origin = get_origin(tp)
    if origin is Annotated:
        return _type_name(get_args(tp)[0])
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in get_args(tp))
    if origin in (list, dict):
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in get_args(tp))}]"
    if tp is type(None):
        return "None"
    if origin is Literal:
        return f"Literal[{', '.join(repr(a) for a in get_args(tp))}]"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def constraints(tp: Any, metadata: list[Any]) -> list[Any]:
    """Every constraint on a field: its own and those of the Annotated aliases it is built from."""
    out: list[Any] = []
    for c in metadata:
        out.extend(c.metadata if isinstance(c, FieldInfo) else [c])
    if get_origin(tp) is Annotated:
        inner, *extra = get_args(tp)
        out.extend(constraints(inner, extra))
    elif get_origin(tp) in (Union, types.UnionType):
        for member in get_args(tp):
            out.extend(constraints(member, []))
    return out


def _values(tp: Any, metadata: list[Any]) -> str:
    """What the collector accepts beyond the type: the range (refused with a 422 naming the field)."""
    lo: str | None = None
    hi: Any = None
    finite = False
    parts = []
    for c in constraints(tp, metadata):
        if isinstance(c, annotated_types.Ge | annotated_types.Gt):
            lo = f">= {c.ge}" if isinstance(c, annotated_types.Ge) else f"> {c.gt}"
        elif isinstance(c, annotated_types.Le):
            hi = c.le
        elif isinstance(c, annotated_types.MaxLen):
            parts.append(f"at most {c.max_length} {'characters' if _is_str(tp) else 'items'}")
        elif isinstance(c, AllowInfNan) and not c.allow_inf_nan:
            finite = True
    if hi is not None:
        bound = _LIMITS.get(hi, str(hi))
        parts.insert(0, f"{lo.split()[1]} .. {bound}" if lo and lo.startswith(">=") else f"<= {bound}")
    elif lo is not None:
        parts.insert(0, lo)
    if "float" in _type_name(tp):
        parts.append("finite" if finite else "NaN, Infinity accepted")
    return ", ".join(parts)


def _is_str(tp: Any) -> bool:
    return "str" in _type_name(tp)


_LIMITS: dict[object, str] = {v1.INT32_MAX: "2^31-1", v1.INT64_MAX: "2^63-1", v1.MAX_STEP: "2^53-1"}


def render() -> str:
    out = [_HEADER]
    for model in _MODELS:
        out.append(f"\n## {model.__name__}\n")
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        if doc:
            out.append(doc + "\n")
        out.append("| field | type | values | default | meaning |\n|---|---|---|---|---|")
        for name, info in model.model_fields.items():
            value = None if info.is_required() else info.get_default(call_default_factory=True)
            default = (
                "required"
                if info.is_required()
                else ("(see below)" if isinstance(value, BaseModel) else f"`{value!r}`")
            )
            desc = (info.description or "").replace("|", "/")
            type_name = _type_name(info.annotation).replace("|", "\\|")
            out.append(f"| `{name}` | `{type_name}` | {_values(info.annotation, info.metadata)} | {default} | {desc} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
