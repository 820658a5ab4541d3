"""Preview pictures of the dashboards, drawn with matplotlib from the generated JSON and the
results of the panels' queries. Grafana cannot run on the project's machines, so this draws
what a panel would show; the pictures are previews, not Grafana screenshots, and say so in
their title.

Each dashboard becomes one PNG, laid out on Grafana's 24-column grid (`gridPos`; one height
unit is ROW_PX pixels, one column COLUMN_PX): rows are thin title bars, and each panel draws
its own query results:

- timeseries: one line (or bars) per series, named by the target's legendFormat, the y axis in
  the panel's unit, thresholds as dashed lines when the panel draws them, and the dashboard's
  annotations as vertical lines (a region when an event lasts longer than one step);
- stat: the reduced value (lastNotNull) of each series with its unit, value mappings, and the
  threshold colour as text or background (colorMode);
- table: the instant results as Grafana frames (Time, labels, `Value` or `Value #<refId>`),
  then the panel's merge and organize transformations, sorted by its sortBy;
- state-timeline: a bar per series wherever the value is 1 (mapped colour);
- heatmap: value by (time bucket, series) from SQL rows (time, metric, value).

A panel without data is drawn as a red "No data", so a broken panel is visible. `render_all`
returns what it drew per panel (PANEL_STATUSES), for a test to assert that every panel had data.

The results file (written by the end-to-end test from a real Prometheus and PostgreSQL)::

    {"start": <unix s>, "end": <unix s>, "step": <s>,
     "variables": {"run": "...", "project": "..."},
     "source": "<optional: where the values come from, shown in the header>",
     "dashboards": {"<uid>": {"<panel id>": {
         "targets": [{"refId": "A", "expr": "...", "instant": false,
                      "result": <Prometheus HTTP API data.result>}],
         "sql": {"columns": ["time", "metric", "value"], "rows": [[...], ...]}}}},
     "annotations": {"<uid>": {"<annotation name>": <Prometheus range data.result>}}}

Usage::

    python -m trainvitals.dashboards.preview RESULTS.json OUTDIR [--dashboards DIR] [--strict]

writes OUTDIR/dashboard-<uid>.png for every dashboard JSON in DIR (default: the generated ones)
and prints each panel's status; `--strict` exits 1 unless every panel was drawn with data.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib
from matplotlib import colors as mcolors
from matplotlib import dates as mdates
from matplotlib.axes import Axes
from matplotlib.figure import Figure  # no pyplot: nothing global, no display
from matplotlib.patches import Rectangle
from matplotlib.ticker import FixedLocator, FuncFormatter, MaxNLocator, MultipleLocator

Json = Mapping[str, Any]
# Annotation name -> (colour, [(start, end) of each event]).
Events = Mapping[str, tuple[Any, list[tuple[float, float]]]]

GENERATED = Path(__file__).resolve().parent / "generated"

# Geometry, in pixels (DPI pixels per inch): Grafana's grid has 24 columns and ~30 px rows.
GRID_COLUMNS = 24
COLUMN_PX = 64
ROW_PX = 30
HEADER_PX = 96
GAP_PX = 3
DPI = 100
WIDTH_PX = GRID_COLUMNS * COLUMN_PX

PREVIEW_TITLE = "PREVIEW drawn from query results, not a Grafana screenshot"

# What render_all reports per panel (rows are not panels and are not reported).
DRAWN = "drawn"  # every query of the panel returned data
PARTIAL = "partial"  # drawn, but some queries returned nothing (named in the panel and in notes)
NO_DATA = "no data"  # the panel's queries returned nothing: drawn as a red "No data"
MISSING = "missing"  # the results file has no entry for the panel: drawn as a red "No data"
UNSUPPORTED = "unsupported"  # a panel type this preview does not draw
COLLAPSED = "collapsed"  # inside a collapsed row: not drawn, as in Grafana
PANEL_STATUSES = (DRAWN, PARTIAL, NO_DATA, MISSING, UNSUPPORTED, COLLAPSED)

# Grafana's dark theme.
PAGE_BG = "#111217"
PANEL_BG = "#181b1f"
BORDER = "#2c3036"
TEXT = "#ccccdc"
DIM_TEXT = "#8e8e9e"
GRID = "#2a2d33"
NO_DATA_RED = "#ff4040"
NOTE_ORANGE = "#ff9830"
PREVIEW_AMBER = "#fade2a"
# Grafana's classic palette, in its order.
PALETTE = (
    "#7eb26d", "#eab839", "#6ed0e0", "#ef843c", "#e24d42", "#1f78c1", "#ba43a9", "#705da0",
    "#508642", "#cca300", "#447ebc", "#c15c17", "#890f02", "#0a437c", "#6d1f62", "#584477",
)  # fmt: skip
NAMED_COLORS = {
    "green": "#73bf69",
    "red": "#f2495c",
    "orange": "#ff9830",
    "yellow": "#fade2a",
    "blue": "#5794f2",
    "purple": "#b877d9",
    "dark-green": "#37872d",
    "dark-red": "#c4162a",
    "dark-orange": "#fa6400",
    "dark-yellow": "#e0b400",
    "dark-blue": "#1f60c4",
    "dark-purple": "#8f3bb8",
    "text": TEXT,
    "transparent": "#00000000",
}

# Time axis tick intervals (UTC-aligned), the first that gives few enough ticks is used.
TICK_SECONDS = (10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
LEGEND_LINE_PX = 12.5  # one line of a legend at font size 6
PT_PX = DPI / 72  # pixels per font point
CHAR_W = 0.6  # average character width, in font heights


# -- reading results ---------------------------------------------------------------------------


@dataclass
class Series:
    """One series of a query result: Grafana's display name, its labels and points."""

    name: str
    labels: dict[str, str]
    times: list[float]
    values: list[float]
    ref: str


@dataclass
class PanelData:
    series: list[Series] = field(default_factory=list)
    empty_refs: list[str] = field(default_factory=list)  # queries that returned nothing
    sql: Json | None = None


def legend_name(fmt: str | None, labels: Mapping[str, str], expr: str = "") -> str:
    """A series' display name the way Grafana's Prometheus datasource makes it: the legendFormat
    with each {{label}} replaced (a missing label by nothing), or else `metric{labels}`, or the
    expression for a series without labels."""
    if fmt and fmt != "__auto":
        return re.sub(r"\{\{\s*(.+?)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt)
    name = labels.get("__name__", "")
    rest = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
    if rest:
        return f"{name}{{{rest}}}"
    return name or expr


def _number(value: Any) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _points(item: Json) -> tuple[list[float], list[float]]:
    if "values" in item:
        pairs = item["values"] or []
    elif "value" in item and item["value"]:
        pairs = [item["value"]]
    else:
        pairs = []
    return [float(t) for t, _ in pairs], [_number(v) for _, v in pairs]


def panel_data(panel: Json, entry: Json) -> PanelData:
    """The series of every target of `panel` in its results `entry`, in the panel's target order,
    named by each target's legendFormat; a target whose result is empty or absent is listed in
    empty_refs (a target of the results that the panel lacks is drawn too, unnamed)."""
    data = PanelData(sql=entry.get("sql"))
    results = {str(t.get("refId", "")): t for t in entry.get("targets") or []}
    sql_refs = [str(t.get("refId", "")) for t in panel.get("targets") or [] if "rawSql" in t]
    formats = {str(t.get("refId", "")): t.get("legendFormat") for t in panel.get("targets") or [] if "rawSql" not in t}
    refs = [*formats, *(r for r in results if r not in formats and r not in sql_refs)]
    for ref in refs:
        result = results.get(ref, {})
        items = result.get("result") or []
        if not items:
            data.empty_refs.append(ref)
        for item in items:
            labels = {str(k): str(v) for k, v in (item.get("metric") or {}).items()}
            times, values = _points(item)
            name = legend_name(formats.get(ref), labels, str(result.get("expr", "")))
            data.series.append(Series(name, labels, times, values, ref))
    if sql_refs and not (data.sql and data.sql.get("rows")):
        data.empty_refs.extend(sql_refs)
    return data


def annotation_events(result: Any, step: float) -> list[tuple[float, float]]:
    """(start, end) of each event of an annotation: the timestamps where its range query
    returned a value, consecutive steps joined into one region (as Grafana does)."""
    items: list[Json] = []
    for item in result or []:
        if isinstance(item, list):  # a list of results rather than one result
            items.extend(item)
        else:
            items.append(item)
    times = sorted({t for item in items for t in _points(item)[0]})
    events: list[tuple[float, float]] = []
    for t in times:
        if events and t - events[-1][1] <= 1.5 * step:
            events[-1] = (events[-1][0], t)
        else:
            events.append((t, t))
    return events


# -- units, thresholds, mappings, colours ------------------------------------------------------


def _defaults(panel: Json) -> Json:
    """The panel's fieldConfig.defaults (unit, thresholds, mappings, custom)."""
    return (panel.get("fieldConfig") or {}).get("defaults") or {}


def _decimal(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value == 0:
        return "0"
    if abs(value) >= 1000:
        return f"{value:.0f}" if abs(value) < 1e15 else f"{value:.3g}"
    digits = max(0, 2 - int(math.floor(math.log10(abs(value)))))
    text = f"{value:.{min(digits, 6)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def _seconds(value: float) -> str:
    size = abs(value)
    if size == 0:
        return "0 s"
    for limit, divisor, unit in (
        (1e-6, 1e-9, "ns"),
        (1e-3, 1e-6, "µs"),
        (1, 1e-3, "ms"),
        (60, 1, "s"),
        (3600, 60, "min"),
        (86400, 3600, "hour"),
    ):
        if size < limit:
            return f"{_decimal(value / divisor)} {unit}"
    return f"{_decimal(value / 86400)} day"


def format_value(value: float, unit: str | None) -> str:
    """`value` in a Grafana unit: s, ms, percent, percentunit, short, none, and the custom
    `suffix:`/`prefix:` units (the text after the colon is attached as written); other unit ids
    are written after the number."""
    if value is None or math.isnan(value) or math.isinf(value):
        return _decimal(math.nan if value is None else value)
    unit = unit or "none"
    if unit == "s":
        return _seconds(value)
    if unit == "ms":
        return _seconds(value / 1000)
    if unit == "percentunit":
        return f"{_decimal(value * 100)}%"
    if unit == "percent":
        return f"{_decimal(value)}%"
    if unit == "short":
        for limit, suffix in ((1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " K")):
            if abs(value) >= limit:
                return f"{_decimal(value / limit)}{suffix}"
        return _decimal(value)
    if unit == "none":
        return _decimal(value)
    if unit.startswith("suffix:"):
        return _decimal(value) + unit[len("suffix:") :]
    if unit.startswith("prefix:"):
        return unit[len("prefix:") :] + _decimal(value)
    return f"{_decimal(value)} {unit}"


def grafana_color(name: str | None, default: str = TEXT) -> Any:
    """A Grafana colour (a palette name, #hex or rgba()) as something matplotlib takes."""
    if not name:
        return default
    if name in NAMED_COLORS:
        return NAMED_COLORS[name]
    match = re.fullmatch(r"rgba?\(\s*([\d.]+)\s*,\s*([\d.]+)\s*,\s*([\d.]+)\s*(?:,\s*([\d.]+)\s*)?\)", name)
    if match:
        r, g, b = (float(match.group(i)) / 255 for i in (1, 2, 3))
        return (r, g, b, float(match.group(4) or 1))
    return name if mcolors.is_color_like(name) else default


def threshold_color(value: float, thresholds: Json | None) -> str | None:
    """The colour of the highest threshold step at or below `value` (absolute mode)."""
    color = None
    for step in (thresholds or {}).get("steps") or []:
        if step.get("value") is None or (not math.isnan(value) and value >= step["value"]):
            color = step.get("color")
    return color


def mapped(value: float, mappings: Sequence[Json] | None) -> tuple[str | None, str | None]:
    """(text, colour) of the first value or range mapping that matches, else (None, None)."""
    for mapping in mappings or []:
        options = mapping.get("options") or {}
        if mapping.get("type") == "value":
            key = _decimal(value)
            if key in options:
                return options[key].get("text"), options[key].get("color")
        elif mapping.get("type") == "range":
            low, high = options.get("from"), options.get("to")
            if (low is None or value >= low) and (high is None or value <= high):
                result = options.get("result") or {}
                return result.get("text"), result.get("color")
    return None, None


def reduce(values: Sequence[float], calc: str) -> float:
    """Grafana's stat reducers that the dashboards use (lastNotNull by default)."""
    finite = [v for v in values if not math.isnan(v)]
    if calc == "last":
        return values[-1] if values else math.nan
    if not finite:
        return math.nan
    return {
        "firstNotNull": finite[0],
        "first": finite[0],
        "max": max(finite),
        "min": min(finite),
        "mean": sum(finite) / len(finite),
        "sum": sum(finite),
    }.get(calc, finite[-1])


# -- tables ------------------------------------------------------------------------------------


@dataclass
class Table:
    columns: list[str]
    rows: list[dict[str, Any]]
    numeric: set[str]
    notes: list[str] = field(default_factory=list)


def table_of(panel: Json, data: PanelData) -> Table:
    """The panel's table: one frame per target (Time, the labels, `Value` for a single query or
    `Value #<refId>` for several), then its merge and organize transformations and its sortBy.
    Other transformations are not applied and are named in `notes`."""
    refs = [s.ref for s in data.series]
    several = len(panel.get("targets") or []) > 1
    frames: list[Table] = []
    for ref in dict.fromkeys(refs):
        value_col = f"Value #{ref}" if several else "Value"
        labels = sorted({k for s in data.series if s.ref == ref for k in s.labels})
        rows = [
            {"Time": s.times[-1], **s.labels, value_col: s.values[-1]} for s in data.series if s.ref == ref and s.times
        ]
        frames.append(Table(["Time", *labels, value_col], rows, {value_col}))
    table = Table([], [], set())
    transformations = panel.get("transformations") or []
    merge = any(t.get("id") == "merge" for t in transformations)
    for frame in frames:
        table.columns += [c for c in frame.columns if c not in table.columns]
        table.numeric |= frame.numeric
        for row in frame.rows:
            target = _merge_target(table, row) if merge else None
            if target is None:
                table.rows.append(dict(row))
            else:
                target.update({k: v for k, v in row.items() if k not in target})
    if len(frames) > 1 and not merge:
        table.notes.append(f"{len(frames)} frames shown together")
    for transformation in transformations:
        kind = transformation.get("id")
        if kind == "organize":
            _organize(table, transformation.get("options") or {})
        elif kind != "merge":
            table.notes.append(f"transformation {kind} not applied")
    for sort in reversed((panel.get("options") or {}).get("sortBy") or []):
        column = sort.get("displayName")
        if column in table.columns:
            present = [r for r in table.rows if r.get(column) is not None]
            absent = [r for r in table.rows if r.get(column) is None]
            present.sort(key=lambda r: (isinstance(r[column], str), r[column]), reverse=bool(sort.get("desc")))
            table.rows = present + absent
    return table


def _merge_target(table: Table, row: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merged row that `row` joins: equal in every label both have (in the time when they
    share none), and without `row`'s value column yet."""
    for candidate in table.rows:
        if any(k in candidate for k in row if k in table.numeric):
            continue
        shared = [k for k in row if k in candidate and k != "Time" and k not in table.numeric]
        keys = shared or ["Time"]
        if all(candidate.get(k) == row.get(k) for k in keys):
            return candidate
    return None


def _organize(table: Table, options: Json) -> None:
    excluded = {k for k, v in (options.get("excludeByName") or {}).items() if v}
    renames = options.get("renameByName") or {}
    order = options.get("indexByName") or {}
    kept = [c for c in table.columns if c not in excluded]
    columns = sorted(kept, key=lambda c: order.get(c, len(order) + kept.index(c)))
    table.columns = [renames.get(c, c) for c in columns]
    table.numeric = {renames.get(c, c) for c in table.numeric}
    table.rows = [{renames.get(c, c): row[c] for c in columns if c in row} for row in table.rows]


# -- drawing -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Box:
    """A rectangle in pixels, from the image's top-left corner."""

    x: float
    y: float
    w: float
    h: float


@dataclass(frozen=True)
class Pixels:
    """Drawing in pixels from the top-left corner of `box`, on the one axes that covers the whole
    page (text, frames, tables, legends): an axes costs more to make and draw than its contents."""

    page: Axes
    box: Box

    def text(self, x: float, y: float, text: str, **kw: Any) -> None:
        self.page.text(self.box.x + x, self.box.y + y, text, parse_math=False, clip_on=False, **kw)

    def line(self, xs: Sequence[float], ys: Sequence[float], **kw: Any) -> None:
        self.page.plot([self.box.x + x for x in xs], [self.box.y + y for y in ys], **kw)

    def rect(self, x: float, y: float, w: float, h: float, **kw: Any) -> None:
        self.page.add_patch(Rectangle((self.box.x + x, self.box.y + y), w, h, **kw))


@dataclass
class Canvas:
    figure: Figure
    width: float
    height: float
    start: float
    end: float
    step: float
    page: Axes = field(init=False)

    def __post_init__(self) -> None:
        self.page = self.figure.add_axes((0, 0, 1, 1))  # first: drawn below the plots
        self.page.set_xlim(0, self.width)
        self.page.set_ylim(self.height, 0)
        self.page.set_axis_off()

    def axes(self, box: Box) -> Axes:
        """Plot axes on `box`."""
        return self.figure.add_axes(
            (box.x / self.width, 1 - (box.y + box.h) / self.height, box.w / self.width, box.h / self.height)
        )

    def pixels(self, box: Box) -> Pixels:
        return Pixels(self.page, box)


def _text(ax: Pixels, x: float, y: float, text: str, *, size: float = 7, color: Any = TEXT, **kw: Any) -> None:
    ax.text(x, y, text, fontsize=size, color=color, **kw)


def _fit(text: str, width_px: float, size: float) -> str:
    """`text` cut with an ellipsis to about `width_px` at font `size`."""
    most = max(1, int(width_px / (size * PT_PX * CHAR_W)))
    return text if len(text) <= most else text[: max(0, most - 1)] + "…"


def _days(seconds: Iterable[float]) -> list[float]:
    return [s / 86400 for s in seconds]  # matplotlib's date numbers: days since 1970-01-01


def _range(start: float, end: float, step: float) -> list[float]:
    return [start + i * step for i in range(int((end - start) // step) + 1)]


def _time_axis(ax: Axes, canvas: Canvas, width_px: float) -> None:
    ax.set_xlim(canvas.start / 86400, canvas.end / 86400)
    span, most = canvas.end - canvas.start, max(2, int(width_px // 90))
    every = next((s for s in TICK_SECONDS if span / s <= most), max(86400.0, span / most))
    first = math.ceil(canvas.start / every) * every
    ax.xaxis.set_major_locator(FixedLocator([t / 86400 for t in _range(first, canvas.end, every)]))
    fmt = "%H:%M" if canvas.end - canvas.start <= 2 * 86400 else "%m-%d %H:%M"
    ax.xaxis.set_major_formatter(mdates.DateFormatter(fmt, tz=UTC))


def _style(ax: Axes) -> None:
    ax.set_facecolor(PANEL_BG)
    ax.tick_params(colors=DIM_TEXT, labelsize=6, length=2, pad=1)
    for spine in ax.spines.values():
        spine.set_visible(False)
    ax.grid(True, color=GRID, linewidth=0.5)
    ax.set_axisbelow(True)


def _legend(canvas: Canvas, box: Box, entries: Sequence[tuple[str, Any]], size: float = 6) -> None:
    """A flowing list legend (colour mark + name) in `box`; entries that do not fit are counted."""
    ax = canvas.pixels(box)
    line_h = size / 6 * LEGEND_LINE_PX
    x, y = 0.0, line_h / 2
    for i, (name, color) in enumerate(entries):
        label = _fit(name, box.w - 16, size)
        width = 16 + len(label) * size * PT_PX * CHAR_W + 10
        if x > 0 and x + width > box.w:
            x, y = 0.0, y + line_h
        if y + line_h / 2 > box.h:
            more = f"+{len(entries) - i} more"
            _text(
                ax,
                box.w - len(more) * size * PT_PX * CHAR_W,
                y - line_h,
                more,
                size=size,
                color=NOTE_ORANGE,
                va="center",
            )
            return
        ax.line([x, x + 10], [y, y], color=color, linewidth=2.5, solid_capstyle="butt")
        _text(ax, x + 14, y, label, size=size, color=TEXT, va="center")
        x += width


def _legend_lines(names: Sequence[str], width: float, size: float = 6) -> int:
    lines, x = 1, 0.0
    for name in names:
        w = 16 + min(len(name) * size * PT_PX * CHAR_W, width - 16) + 10
        if x > 0 and x + w > width:
            lines, x = lines + 1, 0.0
        x += w
    return lines


def _no_data(ax: Pixels, box: Box, reason: str) -> None:
    _text(ax, box.w / 2, box.h / 2, "No data", size=14, color=NO_DATA_RED, ha="center", va="center", weight="bold")
    _text(
        ax, box.w / 2, box.h / 2 + 18, _fit(reason, box.w - 10, 6.5), size=6.5, color=NO_DATA_RED, ha="center", va="top"
    )


def _series_color(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def draw_timeseries(canvas: Canvas, box: Box, panel: Json, data: PanelData, events: Events) -> None:
    defaults = _defaults(panel)
    custom = defaults.get("custom") or {}
    unit = defaults.get("unit")
    legend = ((panel.get("options") or {}).get("legend") or {}).get("showLegend", True)
    names = [s.name for s in data.series]
    legend_h = min(_legend_lines(names, box.w) * LEGEND_LINE_PX + 2, box.h * 0.35) if legend else 0
    finite = [v for s in data.series for v in s.values if math.isfinite(v)] or [0.0]
    ticks = [format_value(v, unit) for v in (min(finite), max(finite), (min(finite) + max(finite)) / 2)]
    axis_w = min(box.w * 0.3, 10 + max(len(t) for t in ticks) * 6 * PT_PX * CHAR_W)
    plot = Box(box.x + axis_w, box.y, box.w - axis_w - 4, box.h - legend_h - 14)
    ax = canvas.axes(plot)
    _style(ax)
    _time_axis(ax, canvas, plot.w)
    ax.yaxis.set_major_locator(MaxNLocator(nbins=max(2, int(plot.h // 28))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: format_value(v, unit)))
    bars = custom.get("drawStyle") == "bars"
    alpha = float(custom.get("fillOpacity", 0)) / 100
    for i, series in enumerate(data.series):
        times, values = _with_gaps(series.times, series.values, canvas.step)
        values = [v if not math.isinf(v) else math.nan for v in values]
        color = _series_color(i)
        if bars:
            ax.bar(_days(times), values, width=canvas.step / 86400 * 0.8, color=color, alpha=max(alpha, 0.3))
        else:
            width = max(0.8, float(custom.get("lineWidth", 1)))
            marker = "o" if len(times) == 1 else None  # a single point (an instant result) has no line
            ax.plot(_days(times), values, color=color, linewidth=width, marker=marker, markersize=3)
            if alpha > 0:
                ax.fill_between(_days(times), values, 0, color=color, alpha=alpha, linewidth=0)
    style = (custom.get("thresholdsStyle") or {}).get("mode", "off")
    if style != "off":  # unlike Grafana, the y range takes in the line: a preview shows the limit
        for step in (defaults.get("thresholds") or {}).get("steps") or []:
            if step.get("value") is not None:
                ax.axhline(step["value"], color=grafana_color(step.get("color")), linestyle="--", linewidth=1)
    if "min" in defaults:
        ax.set_ylim(bottom=defaults["min"])
    if "max" in defaults:
        ax.set_ylim(top=defaults["max"])
    low, high = ax.get_ylim()
    if unit == "s" and high - low > 60:  # ticks on whole minutes, hours, days
        nice = next((t for t in TICK_SECONDS if (high - low) / t <= plot.h // 28), (high - low) / 4)
        ax.yaxis.set_major_locator(MultipleLocator(nice))
    for name, (color, spans) in events.items():
        for t0, t1 in spans:
            if canvas.start <= t1 and t0 <= canvas.end:
                ax.axvline(t0 / 86400, color=color, linewidth=0.9, alpha=0.9, label=name)
                if t1 > t0:
                    ax.axvspan(t0 / 86400, t1 / 86400, color=color, alpha=0.1, linewidth=0)
    if legend:
        entries = [(s.name, _series_color(i)) for i, s in enumerate(data.series)]
        _legend(canvas, Box(box.x + 4, box.y + box.h - legend_h, box.w - 8, legend_h), entries)


def _with_gaps(times: Sequence[float], values: Sequence[float], step: float) -> tuple[list[float], list[float]]:
    """The points with a NaN wherever a step is missing, so that the line breaks there like
    Grafana's (Prometheus leaves out the steps where a series does not exist)."""
    out_t: list[float] = []
    out_v: list[float] = []
    for t, v in zip(times, values, strict=True):
        if out_t and t - out_t[-1] > 1.5 * step:
            out_t.append(out_t[-1] + step)
            out_v.append(math.nan)
        out_t.append(t)
        out_v.append(v)
    return out_t, out_v


def draw_stat(canvas: Canvas, box: Box, panel: Json, data: PanelData) -> None:
    defaults = _defaults(panel)
    options = panel.get("options") or {}
    calc = ((options.get("reduceOptions") or {}).get("calcs") or ["lastNotNull"])[0]
    mode = options.get("textMode", "auto")
    if mode == "auto":
        mode = "value_and_name" if len(data.series) > 1 else "value"
    color_mode = options.get("colorMode", "value")
    ax = canvas.pixels(box)
    n = max(1, len(data.series))
    wide = box.w >= box.h
    cell_w = box.w / n if wide else box.w
    cell_h = box.h if wide else box.h / n
    for i, series in enumerate(data.series):
        value = reduce(series.values, calc)
        text, color = mapped(value, defaults.get("mappings"))
        if text is None:
            text = format_value(value, defaults.get("unit"))
        color = grafana_color(color or threshold_color(value, defaults.get("thresholds")), TEXT)
        x0, y0 = (i * cell_w, 0.0) if wide else (0.0, i * cell_h)
        big = series.name if mode == "name" else text
        show_name = mode == "value_and_name"
        if color_mode == "background":
            ax.rect(x0 + 2, y0 + 2, cell_w - 4, cell_h - 4, color=color)
            color = "white"
        elif color_mode == "none":
            color = TEXT
        name_h = min(cell_h * 0.22, 14) if show_name else 0
        size = min((cell_h - name_h) * 0.55, (cell_w - 8) / (max(len(big), 1) * CHAR_W)) / PT_PX
        if show_name:
            _text(ax, x0 + cell_w / 2, y0 + name_h * 0.6, _fit(series.name, cell_w, name_h * 0.7 / PT_PX),
                  size=name_h * 0.7 / PT_PX, ha="center", va="center")  # fmt: skip
        _text(ax, x0 + cell_w / 2, y0 + name_h + (cell_h - name_h) / 2, big, size=max(size, 5),
              color=color, ha="center", va="center", weight="bold")  # fmt: skip


def draw_table(canvas: Canvas, box: Box, panel: Json, data: PanelData) -> list[str]:
    table = table_of(panel, data)
    unit = _defaults(panel).get("unit")
    ax = canvas.pixels(box)
    size, row_h = 6.5, 13.0

    def cell(column: str, value: Any) -> str:
        if value is None:
            return ""
        if column == "Time" and isinstance(value, float):
            return datetime.fromtimestamp(value, UTC).strftime("%H:%M:%S")
        return format_value(value, unit) if column in table.numeric else str(value)

    cells = [[cell(c, row.get(c)) for c in table.columns] for row in table.rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) + 2 for i, c in enumerate(table.columns)]
    scale = box.w / max(sum(widths), 1)
    xs = [sum(widths[:i]) * scale for i in range(len(widths))]
    for i, column in enumerate(table.columns):
        _text(ax, xs[i] + 2, row_h / 2, _fit(column, widths[i] * scale - 4, size), size=size,
              color="#6e9fff", va="center", weight="bold")  # fmt: skip
    ax.line([0, box.w], [row_h, row_h], color=BORDER, linewidth=1)
    fits = max(0, int((box.h - row_h) // row_h) - 1)
    shown = cells if len(cells) <= fits + 1 else cells[:fits]
    for j, row_cells in enumerate(shown):
        y = row_h * (j + 1.5)
        for i, text in enumerate(row_cells):
            _text(ax, xs[i] + 2, y, _fit(text, widths[i] * scale - 4, size), size=size, va="center")
    notes = list(table.notes)
    if len(shown) < len(cells):
        notes.append(f"+{len(cells) - len(shown)} more rows")
    if notes:
        _text(ax, box.w - 2, box.h - 2, "; ".join(notes), size=6, color=NOTE_ORANGE, ha="right", va="bottom")
    return table.notes


def draw_state_timeline(canvas: Canvas, box: Box, panel: Json, data: PanelData) -> None:
    defaults = _defaults(panel)
    per_page = int((panel.get("options") or {}).get("perPage") or len(data.series) or 1)
    rows = data.series[:per_page]
    label_w = min(box.w * 0.35, 8 + max(len(s.name) for s in rows) * 6 * PT_PX * CHAR_W)
    plot = Box(box.x + label_w, box.y, box.w - label_w - 4, box.h - 14)
    ax = canvas.axes(plot)
    _style(ax)
    ax.grid(False, axis="y")
    _time_axis(ax, canvas, plot.w)
    ax.set_ylim(len(rows) - 0.5, -0.5)
    ax.set_yticks(range(len(rows)), [_fit(s.name, label_w - 6, 6) for s in rows])
    height = float((panel.get("options") or {}).get("rowHeight", 0.8))
    for i, series in enumerate(rows):
        for value_is_one in (True, False):
            spans = [
                (t / 86400, canvas.step / 86400)
                for t, v in zip(series.times, series.values, strict=True)
                if (v == 1) == value_is_one and v != 0 and not math.isnan(v)
            ]
            if spans:
                _, color = mapped(1.0 if value_is_one else 2.0, defaults.get("mappings"))
                fill = grafana_color(color, NAMED_COLORS["red"]) if value_is_one else DIM_TEXT
                ax.broken_barh(spans, (i - height / 2, height), color=fill, linewidth=0)
    if len(data.series) > len(rows):
        more = f"+{len(data.series) - len(rows)} more rows (next pages)"
        _text(canvas.pixels(box), box.w, box.h, more, size=6, color=NOTE_ORANGE, ha="right", va="bottom")


def heatmap_cells(data: PanelData) -> tuple[list[float], list[str], dict[tuple[float, str], float]]:
    """(times, series, {(time, series): value}) of a heatmap from SQL rows (columns time,
    metric, value; times in epoch seconds, milliseconds or ISO text) or from Prometheus series."""
    cells: dict[tuple[float, str], float] = {}
    if data.sql and data.sql.get("rows"):
        columns = [str(c).lower() for c in data.sql.get("columns") or ["time", "metric", "value"]]
        it = columns.index("time") if "time" in columns else 0
        iv = columns.index("value") if "value" in columns else len(columns) - 1
        im = (
            columns.index("metric")
            if "metric" in columns
            else next(i for i in range(len(columns)) if i not in (it, iv))
        )
        for row in data.sql["rows"]:
            cells[(_epoch(row[it]), str(row[im]))] = _number(row[iv])
    else:
        for series in data.series:
            for t, v in zip(series.times, series.values, strict=True):
                cells[(t, series.name)] = v
    return sorted({t for t, _ in cells}), sorted({m for _, m in cells}), cells


def _epoch(value: Any) -> float:
    """A time cell as epoch seconds: a number (seconds or milliseconds, also as text) or ISO text."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    return number / 1000 if number > 1e11 else number


def draw_heatmap(canvas: Canvas, box: Box, panel: Json, data: PanelData) -> None:
    options = panel.get("options") or {}
    color = options.get("color") or {}
    unit = (options.get("cellValues") or {}).get("unit") or _defaults(panel).get("unit")
    times, metrics, cells = heatmap_cells(data)
    if not cells:
        _no_data(canvas.pixels(box), box, "no cells in the result")
        return
    width = min((b - a for a, b in zip(times, times[1:], strict=False)), default=canvas.step)
    grid = [[cells.get((t, m), math.nan) for t in times] for m in metrics]
    plot = Box(box.x + 52, box.y, box.w - 52 - 70, box.h - 14)
    ax = canvas.axes(plot)
    _style(ax)
    ax.grid(False)
    _time_axis(ax, canvas, plot.w)
    edges = _days([*times, times[-1] + width])
    scheme = str(color.get("scheme", "viridis")).lower()
    cmap = matplotlib.colormaps[scheme] if scheme in matplotlib.colormaps else matplotlib.colormaps["viridis"]
    finite = [v for row in grid for v in row if not math.isnan(v)]
    low, high = (min(finite), max(finite)) if finite else (0.0, 1.0)
    norm: mcolors.Normalize
    if color.get("scale") == "exponential" and low >= 0:
        norm = mcolors.PowerNorm(gamma=float(color.get("exponent", 0.5)), vmin=low, vmax=max(high, low + 1e-12))
    else:
        norm = mcolors.Normalize(vmin=low, vmax=max(high, low + 1e-12))
    mesh = ax.pcolormesh(edges, range(len(metrics) + 1), grid, cmap=cmap, norm=norm, shading="flat")
    labels = max(1, int(plot.h // 10))
    every = max(1, math.ceil(len(metrics) / labels))
    ax.set_yticks([i + 0.5 for i in range(0, len(metrics), every)], metrics[::every])
    ax.set_ylim(len(metrics), 0)
    ax.set_ylabel((options.get("yAxis") or {}).get("axisLabel", ""), color=DIM_TEXT, fontsize=6.5)
    bar = canvas.axes(Box(plot.x + plot.w + 8, plot.y, 10, plot.h))
    colorbar = canvas.figure.colorbar(mesh, cax=bar, format=FuncFormatter(lambda v, _pos: format_value(v, unit)))
    colorbar.ax.tick_params(colors=DIM_TEXT, labelsize=6)
    colorbar.outline.set_visible(False)


# -- dashboards --------------------------------------------------------------------------------


@dataclass
class Preview:
    """What render_dashboard drew: the PNG, each panel's status (PANEL_STATUSES) and a note per
    panel where something was not drawn (empty queries, a transformation not applied)."""

    uid: str
    title: str
    path: Path
    panels: dict[str, str]
    titles: dict[str, str]
    notes: dict[str, str]


def grid_rows(board: Json) -> int:
    """The dashboard's height in grid units (its lowest panel's bottom)."""
    return max((p["gridPos"]["y"] + p["gridPos"]["h"] for p in board.get("panels") or []), default=1)


def image_size(board: Json) -> tuple[int, int]:
    """(width, height) in pixels of a dashboard's preview."""
    return WIDTH_PX, HEADER_PX + grid_rows(board) * ROW_PX


def _annotations(board: Json, results: Json) -> Events:
    found = (results.get("annotations") or {}).get(board.get("uid", "")) or {}
    out: dict[str, tuple[Any, list[tuple[float, float]]]] = {}
    for annotation in (board.get("annotations") or {}).get("list") or []:
        if annotation.get("builtIn") or not annotation.get("enable", True):
            continue
        name = annotation.get("name", "")
        events = annotation_events(found.get(name), float(results["step"]))
        out[name] = (grafana_color(annotation.get("iconColor"), NAMED_COLORS["blue"]), events)
    return out


def _header(canvas: Canvas, board: Json, results: Json, events: Events) -> None:
    ax = canvas.pixels(Box(0, 0, canvas.width, HEADER_PX))
    _text(ax, 10, 16, PREVIEW_TITLE, size=13, color=PREVIEW_AMBER, va="center", weight="bold")
    start = datetime.fromtimestamp(canvas.start, UTC).strftime("%Y-%m-%d %H:%M:%S")
    end = datetime.fromtimestamp(canvas.end, UTC).strftime("%Y-%m-%d %H:%M:%S")
    variables = "  ".join(f"{k}={v}" for k, v in (results.get("variables") or {}).items())
    title = board.get("title", board.get("uid"))
    line = f"{title}    {start} to {end} UTC (step {_decimal(canvas.step)} s)    {variables}"
    _text(ax, 10, 38, line, size=10, color=TEXT, va="center")
    if results.get("source"):
        _text(ax, 10, 56, str(results["source"]), size=8, color=NOTE_ORANGE, va="center")
    entries = [
        (f"annotation: {name} ({len(spans)} event{'' if len(spans) == 1 else 's'})", color)
        for name, (color, spans) in events.items()
    ]
    _legend(canvas, Box(10, 66, canvas.width - 20, HEADER_PX - 68), entries, size=7)


def render_dashboard(board: Json, results: Json, out: Path) -> Preview:
    """Draw `board` (Grafana dashboard JSON) from `results` (the module's results format) into
    the PNG `out`; returns each panel's status."""
    uid = str(board.get("uid", ""))
    width, height = image_size(board)
    figure = Figure(figsize=(width / DPI, height / DPI), dpi=DPI, facecolor=PAGE_BG)
    canvas = Canvas(figure, width, height, float(results["start"]), float(results["end"]), float(results["step"]))
    events = _annotations(board, results)
    _header(canvas, board, results, events)
    entries = (results.get("dashboards") or {}).get(uid) or {}
    preview = Preview(uid, str(board.get("title", uid)), out, {}, {}, {})
    for panel in board.get("panels") or []:
        pos = panel["gridPos"]
        box = Box(
            pos["x"] * COLUMN_PX + GAP_PX,
            HEADER_PX + pos["y"] * ROW_PX + GAP_PX,
            pos["w"] * COLUMN_PX - 2 * GAP_PX,
            pos["h"] * ROW_PX - 2 * GAP_PX,
        )
        if panel.get("type") == "row":
            _draw_row(canvas, box, panel, preview)
            continue
        key = str(panel.get("id"))
        preview.titles[key] = str(panel.get("title", ""))
        status, note = _draw_panel(canvas, box, panel, entries.get(key), events)
        preview.panels[key] = status
        if note:
            preview.notes[key] = note
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=DPI, facecolor=PAGE_BG)
    return preview


def _draw_row(canvas: Canvas, box: Box, panel: Json, preview: Preview) -> None:
    ax = canvas.pixels(box)
    title = str(panel.get("title", ""))
    hidden = panel.get("panels") or []
    if panel.get("collapsed") and hidden:
        title += f"  (collapsed: {len(hidden)} panels not drawn)"
        for inner in hidden:
            preview.panels[str(inner.get("id"))] = COLLAPSED
            preview.titles[str(inner.get("id"))] = str(inner.get("title", ""))
    _text(ax, 4, box.h / 2, title, size=10, color=TEXT, va="center", weight="bold")
    ax.line([0, box.w], [box.h - 1, box.h - 1], color=BORDER, linewidth=1)


def _draw_panel(canvas: Canvas, box: Box, panel: Json, entry: Json | None, events: Events) -> tuple[str, str]:
    frame = canvas.pixels(box)
    frame.rect(0, 0, box.w, box.h, facecolor=PANEL_BG, edgecolor=BORDER, linewidth=1)
    _text(frame, 8, 10, _fit(str(panel.get("title", "")), box.w - 16, 8), size=8, va="center", weight="bold")
    inner = Box(box.x + 6, box.y + 22, box.w - 12, box.h - 28)
    local = Box(6, 22, box.w - 12, box.h - 28)
    kind = panel.get("type")
    if entry is None:
        _no_data(frame, box, "the results file has no entry for this panel")
        return MISSING, "no results for this panel"
    data = panel_data(panel, entry)
    has_data = bool(data.series) or bool(data.sql and data.sql.get("rows"))
    if not has_data:
        no_value = _defaults(panel).get("noValue")
        shown = f' (Grafana shows "{no_value}")' if no_value is not None else ""
        _no_data(frame, box, "every query returned an empty result" + shown)
        return NO_DATA, "empty: " + ", ".join(data.empty_refs)
    notes: list[str] = []
    if kind == "timeseries":
        draw_timeseries(canvas, inner, panel, data, events)
    elif kind in ("stat", "gauge", "bargauge"):  # gauges drawn as their number
        draw_stat(canvas, inner, panel, data)
    elif kind == "table":
        notes += draw_table(canvas, inner, panel, data)
    elif kind == "state-timeline":
        draw_state_timeline(canvas, inner, panel, data)
    elif kind == "heatmap":
        draw_heatmap(canvas, inner, panel, data)
    else:
        _text(frame, local.x + local.w / 2, local.y + local.h / 2, f"panel type {kind} is not previewed",
              color=NOTE_ORANGE, ha="center", va="center")  # fmt: skip
        return UNSUPPORTED, f"panel type {kind}"
    if data.empty_refs:
        empty = "no data: query " + ", ".join(data.empty_refs)
        _text(frame, box.w - 8, 10, empty, size=7, color=NO_DATA_RED, ha="right", va="center", weight="bold")
        return PARTIAL, "; ".join([empty, *notes])
    return DRAWN, "; ".join(notes)


def load_results(path: str | Path) -> dict[str, Any]:
    results: dict[str, Any] = json.loads(Path(path).read_text(encoding="utf-8"))
    for key in ("start", "end", "step"):
        if key not in results:
            raise ValueError(f"{path}: the results have no {key!r}")
    return results


def render_all(
    results: Json | str | Path, outdir: str | Path, dashboards: str | Path = GENERATED
) -> dict[str, Preview]:
    """Draw every dashboard JSON in `dashboards` as OUTDIR/dashboard-<uid>.png from `results`
    (a results mapping or file); returns {uid: Preview}."""
    if not isinstance(results, Mapping):
        results = load_results(results)
    previews = {}
    for path in sorted(Path(dashboards).glob("*.json")):
        board = json.loads(path.read_text(encoding="utf-8"))
        uid = str(board.get("uid") or path.stem)
        previews[uid] = render_dashboard(board, results, Path(outdir) / f"dashboard-{uid}.png")
    return previews


def problems(previews: Mapping[str, Preview]) -> list[str]:
    """One line per panel that was not drawn with all its data ("uid panel id title: status,
    note"): empty when every panel was drawn from data."""
    return [
        f"{p.uid} {pid} {p.titles.get(pid, '')}: {status}" + (f" ({p.notes[pid]})" if p.notes.get(pid) else "")
        for p in previews.values()
        for pid, status in p.panels.items()
        if status != DRAWN
    ]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainvitals.dashboards.preview",
        description="Draw PNG previews of the dashboards from query results (not Grafana screenshots).",
    )
    parser.add_argument("results", type=Path, help="results JSON (see the module's docstring)")
    parser.add_argument("outdir", type=Path, help="where dashboard-<uid>.png are written")
    parser.add_argument("--dashboards", type=Path, default=GENERATED, help="directory of dashboard JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 unless every panel was drawn with data")
    args = parser.parse_args(argv)
    previews = render_all(args.results, args.outdir, args.dashboards)
    for preview in previews.values():
        print(f"{preview.path}  ({preview.title})")
        for pid, status in preview.panels.items():
            note = f"  {preview.notes[pid]}" if preview.notes.get(pid) else ""
            print(f"  {pid:>5} {status:<11} {preview.titles.get(pid, '')}{note}")
    bad = problems(previews)
    print(f"{sum(len(p.panels) for p in previews.values()) - len(bad)} panels drawn with data, {len(bad)} not")
    return 1 if args.strict and bad else 0


if __name__ == "__main__":
    sys.exit(main())
