"""Docs that are generated or promise a complete list stay in sync with the code."""

from pathlib import Path

from trainvitals.wire.docs import render

ROOT = Path(__file__).resolve().parents[1]


def test_wire_format_doc_is_generated_from_the_models() -> None:
    assert (ROOT / "docs" / "wire-format.md").read_text() == render(), (
        "regenerate: python -m trainvitals.wire.docs > docs/wire-format.md"
    )


def test_every_exported_family_is_documented(tmp_path: Path) -> None:
    import re

    # The run families (exposition.py) and the collector's per-process ones (self_metrics.py).
    source = "".join((ROOT / "service" / f).read_text() for f in ("exposition.py", "self_metrics.py"))
    families = set(re.findall(r'"(trainvitals_[a-z_]+)"', source))
    counters = set(re.findall(r'Counter(?:MetricFamily)?\(\s*"(trainvitals_[a-z_]+)"', source))
    doc = (ROOT / "docs" / "metrics.md").read_text()
    missing = [f for f in families if f"`{f + '_total' if f in counters else f}`" not in doc]
    assert len(families) > 40 and not missing, missing


def test_cli_doc_quotes_the_schema_head() -> None:
    """docs/cli.md quotes the schema-revision messages; they named 0017 after 0018 was the head."""
    import re

    from alembic.script import ScriptDirectory

    from trainvitals.service.store import db

    script = ScriptDirectory.from_config(db.alembic_config("sqlite://"))
    head = script.get_current_head()
    previous = script.get_revision(head).down_revision
    doc = (ROOT / "docs" / "cli.md").read_text()
    quoted = {
        "older": re.findall(r"schema revision (\d{4}), this trainvitals reads (\d{4})", doc),
        "newer": re.findall(r"this trainvitals \(schema (\d{4})\)", doc),
        "known": re.findall(r"\+N/-N or 0001\.\.(\d{4})", doc),
    }
    assert quoted == {"older": [(previous, head)], "newer": [head], "known": [head]}, f"head is {head}"
