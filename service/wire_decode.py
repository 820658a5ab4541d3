"""The ingest fast path's decoder for wire-format batches: msgspec structs mirroring wire.v1.

pydantic's `Batch.model_validate_json` was a quarter of the collector's CPU under load (a model
object per record). msgspec decodes and validates the same JSON into slotted structs several times
faster. The pydantic models stay the contract: they generate the docs and the OpenAPI schema,
and whenever msgspec refuses a body, the route re-validates it with pydantic so the 422 names the
field in the usual words. tests/service/test_wire_decode.py holds the two to the same verdicts and
values on valid and mutated batches; change both modules together.

The structs quack like the pydantic records where ingest reads them: same attribute names, and a
class attribute `kind`.
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

import msgspec
from msgspec import Meta, Struct

from trainvitals.wire.v1 import MAX_RECORDS_PER_BATCH

_Name = Annotated[str, Meta(min_length=1, max_length=256)]
# \Z, not $: Python's $ also matches before a trailing newline, pydantic's (Rust) regex does not.
_RunId = Annotated[str, Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:\-]+\Z")]
_NonNeg = Annotated[float, Meta(ge=0)]
_Count = Annotated[int, Meta(ge=0)]
_Fraction = Annotated[float, Meta(ge=0, le=1)]
_Text = Annotated[str, Meta(max_length=4096)]


class _Record(Struct, forbid_unknown_fields=True, frozen=True, tag_field="kind"):
    kind: ClassVar[str]


class StepRecord(_Record, tag="step"):
    kind: ClassVar[str] = "step"
    step: _Count
    ts: float
    step_seconds: _NonNeg
    compute_seconds: _NonNeg | None = None
    wait_seconds: _NonNeg | None = None
    data_seconds: _NonNeg | None = None
    loss: float | None = None
    tokens: _Count | None = None
    flops: _NonNeg | None = None
    lr: float | None = None
    grad_norm: float | None = None
    pp_stage: _Count | None = None
    tp_rank: _Count | None = None
    dp_rank: _Count | None = None
    mem_allocated_bytes: _Count | None = None
    mem_reserved_bytes: _Count | None = None


class TensorRecord(_Record, tag="tensor"):
    kind: ClassVar[str] = "tensor"
    step: _Count
    tensor: _Name
    role: Literal["input", "weight", "grad_output"]
    format: Literal["e4m3", "e5m2"]
    amax: float
    scale: float | None = None
    headroom_bits: float | None = None
    lag_bits: float | None = None
    staleness_steps: _Count | None = None
    sat_frac: _Fraction | None = None
    underflow_frac: _Fraction | None = None
    crest_bits: float | None = None
    nonfinite: _Count | None = None
    shadow: bool = False


class GradRecord(_Record, tag="grad"):
    kind: ClassVar[str] = "grad"
    step: _Count
    group: _Name
    owned_sq: float
    local_sq: float
    nonfinite: _Count = 0


class CheckpointRecord(_Record, tag="checkpoint"):
    kind: ClassVar[str] = "checkpoint"
    step: _Count
    generation: _Count
    status: Literal["started", "persisted", "failed", "verified"]
    ts: float
    path: _Text | None = None
    bytes: _Count | None = None
    stall_seconds: _NonNeg | None = None
    persist_seconds: _NonNeg | None = None
    checksum: Annotated[str, Meta(max_length=128)] | None = None
    error: _Text | None = None


class EventRecord(_Record, tag="event"):
    kind: ClassVar[str] = "event"
    ts: float
    event: Literal["start", "restart", "resume", "failure", "node_replaced", "phase_change", "rollback", "stop", "note"]
    step: _Count | None = None
    detail: _Text | None = None
    domains: Annotated[dict[str, str], Meta(max_length=16)] = {}


Record = StepRecord | TensorRecord | GradRecord | CheckpointRecord | EventRecord


class Batch(Struct, forbid_unknown_fields=True, frozen=True):
    run: _RunId
    rank: _Count
    incarnation: _Count
    seq: _Count
    records: Annotated[list[Record], Meta(max_length=MAX_RECORDS_PER_BATCH)]
    wire_version: Literal[1] = 1
    sent_at: float | None = None


_DECODER = msgspec.json.Decoder(Batch)


def decode_batch(body: bytes) -> Batch:
    """Decode and validate one batch body; raises msgspec.ValidationError / DecodeError."""
    return _DECODER.decode(body)
