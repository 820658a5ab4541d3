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
