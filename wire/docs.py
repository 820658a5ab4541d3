"""Render the wire-format models as Markdown tables (docs/wire-format.md is generated from this
and a test keeps the two in sync)."""

from __future__ import annotations

from pydantic import BaseModel

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

## Run ids

A run id names one job. Registering an id the collector already holds is one of two things:

- **A relaunch of the same job** (a crash, a requeue, torchrun restarting it, the same script run
  again): the project agrees and so does every identity field the registration sends,
  `model.hidden` / `heads` / `kv_heads` / `ffn_hidden` / `vocab` and `parallelism.world_size` /
  `tp` / `pp` / `cp` / `ep` (a field absent or null on either side contradicts nothing). Accepted
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


def _type_name(annotation: object) -> str:
    text = str(annotation).replace("typing.", "")
    for prefix in ("trainvitals.wire.v1.",):
        text = text.replace(prefix, "")
    return text.replace("<class '", "").replace("'>", "")


def render() -> str:
    out = [_HEADER]
    for model in _MODELS:
        out.append(f"\n## {model.__name__}\n")
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        if doc:
            out.append(doc + "\n")
        out.append("| field | type | default | meaning |\n|---|---|---|---|")
        for name, info in model.model_fields.items():
            value = None if info.is_required() else info.get_default(call_default_factory=True)
            default = (
                "required"
                if info.is_required()
                else ("(see below)" if isinstance(value, BaseModel) else f"`{value!r}`")
            )
            desc = (info.description or "").replace("|", "/")
            type_name = _type_name(info.annotation).replace("|", "\\|")
            out.append(f"| `{name}` | `{type_name}` | {default} | {desc} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print(render(), end="")
