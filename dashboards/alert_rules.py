"""The links in the alert rules: each alert's `dashboard_url` (the panel that shows its problem)
and `runbook_url` (its section of docs/runbooks.md), written into
dashboards/alerts/trainvitals-alerts.yml for one installation's Grafana and docs.

The rules file is its own source: everything in it is edited by hand except these two
annotations, which `render` rewrites (and nothing else, byte for byte, comments included). The
committed file holds them for the placeholder `Config()`; an installation regenerates with its
own URLs (`trainvitals dashboards write DIR --grafana-url ... --runbook-base-url ...`).

Where an alert links:
- `dashboard_url` = `<grafana_url>/d/<uid>?var-run={{ $labels.run }}&viewPanel=<id>`. The uid
  and the panel id are read from the dashboards the builders make (`ALERT_PANELS` names a
  dashboard by its uid constant and a panel by its title), so a panel that moves takes its
  alerts with it, and a panel that is renamed or removed stops the generation.
- `runbook_url` = `<runbook_base_url>#<anchor>`, the anchor being the alert's name in words
  (TrainvitalsFp8Clipping -> `fp8-clipping`, the heading "## FP8 clipping"). One convention
  instead of a table: tests/dashboards checks that every anchor is a heading of docs/runbooks.md.

Usage::

    from trainvitals.dashboards import alert_rules, generate

    text = alert_rules.render(
        alert_rules.SOURCE.read_text(),
        boards=generate.build_all(),
        config=alert_rules.Config(grafana_url="https://grafana.corp", runbook_base_url="https://wiki/runbooks.md"),
    )
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from grafana_foundation_sdk.models import dashboard as dash_m

from trainvitals.dashboards import panels as p

# Placeholders: an operator must set both (docs/dashboards.md). `.example` is reserved (RFC 2606),
# so a link nobody configured fails to resolve instead of reaching someone else's host.
DEFAULT_GRAFANA_URL = "http://grafana.example:3000"
DEFAULT_RUNBOOK_BASE_URL = "https://trainvitals.example/docs/runbooks.md"

# The committed rules, read as the source of everything but the two URL annotations.
SOURCE = Path(__file__).resolve().parent / "alerts" / "trainvitals-alerts.yml"
RULES_FILE_NAME = SOURCE.name

URL_ANNOTATIONS = ("dashboard_url", "runbook_url")
_PREFIX = "Trainvitals"


@dataclass(kw_only=True, slots=True, frozen=True)
class Config:
    """Where the alerts' links point, for one installation.

    Example: ``Config(grafana_url="https://grafana.corp/grafana", runbook_base_url=
    "https://github.com/org/trainvitals/blob/main/docs/runbooks.md")``.
    """

    grafana_url: str = DEFAULT_GRAFANA_URL
    """Grafana's root URL as users reach it (a sub-path is kept; a trailing slash is dropped)."""
    runbook_base_url: str = DEFAULT_RUNBOOK_BASE_URL
    """URL of a rendered docs/runbooks.md; each alert appends `#<its section's anchor>`."""

    def __post_init__(self) -> None:
        _check_url("grafana_url", self.grafana_url, allow_query=False)
        _check_url("runbook_base_url", self.runbook_base_url, allow_query=True)


def _check_url(name: str, url: str, *, allow_query: bool) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"{name} must be an absolute http(s) URL, got {url!r}")
    if parts.fragment or url.endswith("#"):
        raise ValueError(f"{name} must not have a #fragment (the alert adds its own), got {url!r}")
    if parts.query and not allow_query:
        raise ValueError(f"{name} must not have a ?query (the alert adds its own), got {url!r}")
    # The URL lands inside a one-line YAML string that Prometheus expands as a Go template.
    if not url.isascii() or any(c.isspace() for c in url) or "{{" in url or "}}" in url:
        raise ValueError(f"{name} must be plain ASCII without spaces or '{{{{ }}}}', got {url!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class AlertPanel:
    """The panel that shows an alert's problem."""

    board: str
    """uid of the dashboard (a constant of dashboards/panels.py)."""
    title: str
    """Title of the panel in that dashboard; exactly one panel may have it."""
    evidence: str | None = None
    """For an alert on a detector finding (its expr reads only trainvitals_finding_active, which
    the Findings row draws for every kind): the exported series of the detector's input that
    the panel draws. tests/dashboards checks that the panel queries it."""
    per_run: bool = True
    """The alert has a `run` label, and the link selects that run (`var-run`)."""


# One entry per alert of the rules file; the panel answers "what does the problem look like".
ALERT_PANELS: dict[str, AlertPanel] = {
    # Recurring spikes of the global gradient norm (the usual first sign); a loss divergence
    # shows on the Loss panel beside it in the same row.
    "TrainvitalsLateDivergence": AlertPanel(
        board=p.RUN_UID, title="Gradient norm", evidence="trainvitals_run_grad_norm"
    ),
    # The detector compares block medians of the global gradient norm with an earlier level.
    "TrainvitalsGradNormDrift": AlertPanel(
        board=p.RUN_UID, title="Gradient norm", evidence="trainvitals_run_grad_norm"
    ),
    # grad_nonfinite is the common kind; FP8 and loss non-finite values have no panel of their own.
    "TrainvitalsNonFiniteGradients": AlertPanel(
        board=p.RUN_UID, title="Parameters with non-finite gradients", evidence="trainvitals_run_grad_nonfinite_params"
    ),
    # Clipping is headroom below 0 bits: the saturated-tensor count is that condition.
    "TrainvitalsFp8Clipping": AlertPanel(
        board=p.RUN_UID, title="Saturated tensors", evidence="trainvitals_fp8_saturated_tensors"
    ),
    # The detector follows the trend of per-tensor minimum headroom; the panel draws it per layer.
    "TrainvitalsFp8HeadroomExhaustion": AlertPanel(
        board=p.RUN_UID,
        title="Minimum FP8 headroom per layer and role (20 tightest)",
        evidence="trainvitals_fp8_layer_min_headroom_log2",
    ),
    # Jumps and stale scales move the headroom; amax and underflow are not exported, so the
    # headroom per layer is the nearest drawing of these kinds.
    "TrainvitalsFp8Precision": AlertPanel(
        board=p.RUN_UID,
        title="Minimum FP8 headroom per layer and role (20 tightest)",
        evidence="trainvitals_fp8_layer_min_headroom_log2",
    ),
    # The detector's quantity, against its 12-bit line.
    "TrainvitalsFp8Crest": AlertPanel(
        board=p.RUN_UID, title="FP8 crest of the widest E4M3 tensors", evidence="trainvitals_fp8_worst_crest_log2"
    ),
    # The detector's quantity: a rank's compute time over its stage cohort's median.
    "TrainvitalsStraggler": AlertPanel(
        board=p.RUN_UID, title="Slowest ranks over their cohort", evidence="trainvitals_rank_slowest_cohort_ratio"
    ),
    "TrainvitalsStageImbalance": AlertPanel(
        board=p.RUN_UID, title="Step time per pipeline stage", evidence="trainvitals_run_stage_step_seconds"
    ),
    "TrainvitalsMfuGap": AlertPanel(board=p.RUN_UID, title="MFU gap", evidence="trainvitals_run_mfu_ratio"),
    # The measured line above 100%, next to the prediction.
    "TrainvitalsMfuImpossible": AlertPanel(
        board=p.RUN_UID, title="MFU: measured vs predicted", evidence="trainvitals_run_mfu_ratio"
    ),
    "TrainvitalsCheckpointFailed": AlertPanel(
        board=p.RUN_UID, title="Checkpoint records by status", evidence="trainvitals_checkpoint_records"
    ),
    "TrainvitalsCheckpointOverdue": AlertPanel(
        board=p.RUN_UID,
        title="Checkpoint age vs recommended interval",
        evidence="trainvitals_checkpoint_last_persisted_age_seconds",
    ),
    # A rollback target is a persisted checkpoint before the onset step: the panel gives the
    # steps back to the newest one (empty: none persisted).
    "TrainvitalsNoRollbackTarget": AlertPanel(
        board=p.RUN_UID,
        title="Steps since the newest persisted checkpoint",
        evidence="trainvitals_checkpoint_last_persisted_step",
    ),
    "TrainvitalsRunStalled": AlertPanel(board=p.RUN_UID, title="Stalled?"),
    "TrainvitalsAnalysisBehind": AlertPanel(board=p.RUN_UID, title="Analysis lag"),
    # The collector's own finding about a run; the panel counts the analysis errors it comes from.
    "TrainvitalsAnalysisFailing": AlertPanel(
        board=p.RUN_UID, title="Analysis errors", evidence="trainvitals_analysis_errors_total"
    ),
    "TrainvitalsAgentDroppingRecords": AlertPanel(board=p.RUN_UID, title="Records the agents lost, by reason"),
    # About a collector instance, not a run.
    "TrainvitalsCollectorDown": AlertPanel(board=p.RUN_UID, title="Scrape of the collector", per_run=False),
    "TrainvitalsIngestSaturated": AlertPanel(board=p.RUN_UID, title="Ingest writers busy", per_run=False),
}


def runbook_anchor(alert: str) -> str:
    """The anchor of the alert's runbook section: its name in words, lower case, dash-joined
    (TrainvitalsNonFiniteGradients -> non-finite-gradients)."""
    if not alert.startswith(_PREFIX) or alert == _PREFIX:
        raise ValueError(f"alert {alert!r} does not start with {_PREFIX!r}")
    words = re.findall(r"[A-Z][a-z0-9]*", alert.removeprefix(_PREFIX))
    if "".join(words) != alert.removeprefix(_PREFIX):
        raise ValueError(f"alert {alert!r} is not CamelCase words")
    return "-".join(w.lower() for w in words)


def _panel_ids(board: dash_m.Dashboard) -> dict[str, list[int]]:
    """{title: ids} of every panel (not rows), those inside collapsed rows included."""
    out: dict[str, list[int]] = {}
    for panel in board.panels or []:
        inner = panel.panels if isinstance(panel, dash_m.RowPanel) else [panel]
        for pn in inner:
            if isinstance(pn, dash_m.Panel):
                out.setdefault(pn.title or "", []).append(pn.id_val or 0)
    return out


def links(boards: Iterable[dash_m.Dashboard], config: Config) -> dict[str, dict[str, str]]:
    """{alert: {"dashboard_url": ..., "runbook_url": ...}} for every alert of ALERT_PANELS."""
    by_uid = {b.uid: _panel_ids(b) for b in boards}
    grafana = config.grafana_url.rstrip("/")
    out: dict[str, dict[str, str]] = {}
    for alert, ref in ALERT_PANELS.items():
        if ref.board not in by_uid:
            raise ValueError(f"{alert}: no dashboard with uid {ref.board!r}")
        ids = by_uid[ref.board].get(ref.title, [])
        if len(ids) != 1:
            raise ValueError(f"{alert}: {len(ids)} panels titled {ref.title!r} in {ref.board}, need exactly one")
        # Run ids are [A-Za-z0-9._:-] (wire/v1.py): safe in a query string unescaped.
        run = "var-run={{ $labels.run }}&" if ref.per_run else ""
        out[alert] = {
            "dashboard_url": f"{grafana}/d/{ref.board}?{run}viewPanel={ids[0]}",
            "runbook_url": f"{config.runbook_base_url}#{runbook_anchor(alert)}",
        }
    return out


_RULE_LINE = re.compile(r"^\s*- (?P<kind>alert|record):\s*(?P<name>\S+)\s*$")
_ANNOTATIONS_LINE = re.compile(r"^(?P<indent> *)annotations:\s*$")
_URL_LINE = re.compile(r"^(?P<indent> *)(?P<key>dashboard_url|runbook_url):(?:\s.*)?$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _quoted(value: str) -> str:
    """A YAML single-quoted scalar (no escapes but a doubled quote)."""
    return "'" + value.replace("'", "''") + "'"


def render(source: str, *, boards: Iterable[dash_m.Dashboard], config: Config) -> str:
    """`source` (the rules YAML) with each alert's dashboard_url and runbook_url set from
    `boards` and `config`; every other byte is kept.

    Each alert must already have both annotations, one line each, directly in its
    `annotations:` mapping (any value: a new alert gets `dashboard_url: ''` and
    `runbook_url: ''`), and an entry in ALERT_PANELS.
    """
    wanted = links(boards, config)
    out: list[str] = []
    seen: dict[str, set[str]] = {}
    alert: str | None = None
    in_annotations = False
    annotations_indent = 0
    entry_indent: int | None = None  # indent of the current alert's annotation keys
    replaced: str | None = None  # the URL annotation on the previous line: its value must end there
    for line in source.splitlines(keepends=True):
        body = line.rstrip("\n")
        stripped = body.strip()
        if not stripped or stripped.startswith("#"):
            out.append(line)
            continue
        if replaced is not None and in_annotations and _indent(body) > (entry_indent or 0):
            raise ValueError(f"alert {alert}: {replaced} must be a one-line value")
        replaced = None
        if m := _RULE_LINE.match(body):
            alert, in_annotations, entry_indent = (m["name"] if m["kind"] == "alert" else None), False, None
            if alert is not None:
                if alert in seen:
                    raise ValueError(f"alert {alert} appears twice")
                seen[alert] = set()
        elif alert is not None and (m := _ANNOTATIONS_LINE.match(body)):
            in_annotations, annotations_indent, entry_indent = True, len(m["indent"]), None
        elif in_annotations:
            if _indent(body) <= annotations_indent:
                in_annotations = False
            elif entry_indent is None:
                entry_indent = _indent(body)
            if in_annotations and _indent(body) == entry_indent and (m := _URL_LINE.match(body)):
                assert alert is not None
                if alert not in wanted:
                    raise ValueError(f"alert {alert} has no panel in ALERT_PANELS (dashboards/alert_rules.py)")
                key = m["key"]
                if key in seen[alert]:
                    raise ValueError(f"alert {alert} has {key} twice")
                seen[alert].add(key)
                replaced = key
                line = f"{m['indent']}{key}: {_quoted(wanted[alert][key])}" + line[len(body) :]
        out.append(line)
    for name, keys in seen.items():
        missing = [k for k in URL_ANNOTATIONS if k not in keys]
        if missing:
            raise ValueError(f"alert {name} lacks the annotation(s) {missing}: add them with '' as the value")
    stale = sorted(set(wanted) - set(seen))
    if stale:
        raise ValueError(f"ALERT_PANELS names alerts the rules do not have: {stale}")
    return "".join(out)
