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

    source = (ROOT / "service" / "exposition.py").read_text()
    families = set(re.findall(r'"(trainvitals_[a-z_]+)"', source))
    doc = (ROOT / "docs" / "metrics.md").read_text()
    counters = {
        f for f in families if f'CounterMetricFamily("{f}"' in source.replace("\n", "").replace(" ", "")
    }
    missing = [f for f in families if (f + "_total" if f in counters else f) not in doc]
    assert families and not missing, missing
