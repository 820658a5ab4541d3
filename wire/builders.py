"""Typed builders of the wire's JSON objects: what the agent sends, spelled once.

One keyword-only function per record kind of wire/v1.py, plus the batch envelope. They return
plain dicts, the JSON objects of the wire, and leave out optional fields that are None (the
collector's models fill in the same defaults). Not pydantic objects: the agent builds these on
its training and exporter threads, and `StepRecord.model_construct(...)` costs ~6.6 us where a
dict literal costs ~0.14 us (measured on the development machine); validation is the
collector's job.

The pydantic models in wire/v1.py stay the single source of truth: tests/wire/test_builders.py
derives each builder's expected signature from its model (same names, required fields required,
optional ones defaulting to None or the model's default) and validates every builder's output
with the model, so a field added to a model without its builder fails a test.

Usage::

    rec = step_record(step=12, ts=time.time(), step_seconds=0.41, tokens=4096)
    head = batch_header(run="r1", rank=0, incarnation=inc, seq=3, sent_at=time.time())
    body = {**head, "records": [rec]}
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from trainvitals.wire.conventions import WIRE_VERSION, CheckpointStatus, EventKind, Fp8Format, Role

JsonObject = dict[str, Any]
"""A wire message or record as the JSON object it is sent as."""


def step_record(
    *,
    step: int,
    ts: float,
    step_seconds: float,
    compute_seconds: float | None = None,
    wait_seconds: float | None = None,
    data_seconds: float | None = None,
    loss: float | None = None,
    tokens: int | None = None,
    flops: float | None = None,
    lr: float | None = None,
    grad_norm: float | None = None,
    pp_stage: int | None = None,
    tp_rank: int | None = None,
    dp_rank: int | None = None,
    skipped: bool = False,
) -> JsonObject:
    """A `StepRecord`: one optimizer step on one rank."""
    rec: JsonObject = {"kind": "step", "step": step, "ts": ts, "step_seconds": step_seconds}
    if compute_seconds is not None:
        rec["compute_seconds"] = compute_seconds
    if wait_seconds is not None:
        rec["wait_seconds"] = wait_seconds
    if data_seconds is not None:
        rec["data_seconds"] = data_seconds
    if loss is not None:
        rec["loss"] = loss
    if tokens is not None:
        rec["tokens"] = tokens
    if flops is not None:
        rec["flops"] = flops
    if lr is not None:
        rec["lr"] = lr
    if grad_norm is not None:
        rec["grad_norm"] = grad_norm
    if pp_stage is not None:
        rec["pp_stage"] = pp_stage
    if tp_rank is not None:
        rec["tp_rank"] = tp_rank
    if dp_rank is not None:
        rec["dp_rank"] = dp_rank
    if skipped:
        rec["skipped"] = True
    return rec


def tensor_record(
    *,
    step: int,
    tensor: str,
    role: Role,
    format: Fp8Format,  # the wire's field name, shadowing the builtin here only
    amax: float,
    scale: float | None = None,
    headroom_bits: float | None = None,
    lag_bits: float | None = None,
    staleness_steps: int | None = None,
    sat_frac: float | None = None,
    underflow_frac: float | None = None,
    crest_bits: float | None = None,
    nonfinite: int | None = None,
    shadow: bool = False,
) -> JsonObject:
    """A `TensorRecord`: FP8 statistics of one (module, role) at one step."""
    rec: JsonObject = {
        "kind": "tensor",
        "step": step,
        "tensor": tensor,
        "role": role,
        "format": format,
        "amax": amax,
        "shadow": shadow,
    }
    if scale is not None:
        rec["scale"] = scale
    if headroom_bits is not None:
        rec["headroom_bits"] = headroom_bits
    if lag_bits is not None:
        rec["lag_bits"] = lag_bits
    if staleness_steps is not None:
        rec["staleness_steps"] = staleness_steps
    if sat_frac is not None:
        rec["sat_frac"] = sat_frac
    if underflow_frac is not None:
        rec["underflow_frac"] = underflow_frac
    if crest_bits is not None:
        rec["crest_bits"] = crest_bits
    if nonfinite is not None:
        rec["nonfinite"] = nonfinite
    return rec


def grad_record(*, step: int, group: str, owned_sq: float, local_sq: float, nonfinite: int = 0) -> JsonObject:
    """A `GradRecord`: gradient sums of squares of one parameter group at one step."""
    return {
        "kind": "grad",
        "step": step,
        "group": group,
        "owned_sq": owned_sq,
        "local_sq": local_sq,
        "nonfinite": nonfinite,
    }


def checkpoint_record(
    *,
    step: int,
    generation: int,
    status: CheckpointStatus,
    ts: float,
    path: str | None = None,
    bytes: int | None = None,  # the wire's field name, shadowing the builtin here only
    stall_seconds: float | None = None,
    persist_seconds: float | None = None,
    checksum: str | None = None,
    error: str | None = None,
    saved_by_incarnation: int | None = None,
) -> JsonObject:
    """A `CheckpointRecord`: one state change of one checkpoint generation."""
    rec: JsonObject = {"kind": "checkpoint", "step": step, "generation": generation, "status": status, "ts": ts}
    if path is not None:
        rec["path"] = path
    if bytes is not None:
        rec["bytes"] = bytes
    if stall_seconds is not None:
        rec["stall_seconds"] = stall_seconds
    if persist_seconds is not None:
        rec["persist_seconds"] = persist_seconds
    if checksum is not None:
        rec["checksum"] = checksum
    if error is not None:
        rec["error"] = error
    if saved_by_incarnation is not None:
        rec["saved_by_incarnation"] = saved_by_incarnation
    return rec


def event_record(
    *,
    ts: float,
    event: EventKind,
    step: int | None = None,
    detail: str | None = None,
    domains: Mapping[str, str] | None = None,
) -> JsonObject:
    """An `EventRecord`. `domains` None or empty is left out (the model's default: no tags)."""
    rec: JsonObject = {"kind": "event", "ts": ts, "event": event}
    if step is not None:
        rec["step"] = step
    if detail is not None:
        rec["detail"] = detail
    if domains:
        rec["domains"] = dict(domains)
    return rec


def batch_header(*, run: str, rank: int, incarnation: int, seq: int, sent_at: float | None = None) -> JsonObject:
    """A `Batch` without its records: the sender adds `"records"` (the agent splices the
    already-encoded records in after this object's fields)."""
    head: JsonObject = {
        "wire_version": WIRE_VERSION,
        "run": run,
        "rank": rank,
        "incarnation": incarnation,
        "seq": seq,
    }
    if sent_at is not None:
        head["sent_at"] = sent_at
    return head


__all__ = [
    "JsonObject",
    "batch_header",
    "checkpoint_record",
    "event_record",
    "grad_record",
    "step_record",
    "tensor_record",
]
