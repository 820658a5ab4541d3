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
