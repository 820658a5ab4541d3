"""Shared pieces of the trainvitals Grafana dashboards: datasource references, variables, query
builders and one factory per visualisation.

Every factory takes the panel id, a unit and a description as required keyword arguments, and
sets the dashboard's datasource variable on the panel and on each of its queries, so a panel
cannot be built without them (the tests in tests/dashboards check the generated JSON as well).

Panel ids are fixed by the builders (row N has id N*100, its panels N*100+1 ...): alerts and
docs link to `/d/<uid>?viewPanel=<id>`, so an id must not move when a panel is added elsewhere.

Usage::

    from trainvitals.dashboards import panels as p

    board.with_panel(
        p.timeseries(
            201, "Tokens per second", unit=p.TOKENS_PER_SECOND, description="...",
            targets=[p.prom('max by (run) (trainvitals_run_tokens_per_second{run="$run"})', legend="{{run}}")],
        )
    )
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from grafana_foundation_sdk.builders import common as common_b
from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.builders import heatmap as heatmap_b
from grafana_foundation_sdk.builders import prometheus as prom_b
from grafana_foundation_sdk.builders import stat as stat_b
from grafana_foundation_sdk.builders import statetimeline as statetimeline_b
from grafana_foundation_sdk.builders import table as table_b
from grafana_foundation_sdk.builders import timeseries as timeseries_b
from grafana_foundation_sdk.cog import builder as cog_builder
from grafana_foundation_sdk.cog import variants as cog_variants
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m
from grafana_foundation_sdk.models import heatmap as heatmap_m
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

# Dashboard uids: stable, they are part of every link to a dashboard (and of alert dashboard_urls).
FLEET_UID = "trainvitals-fleet"
RUN_UID = "trainvitals-run"
TAG = "trainvitals"

# Datasource plugin ids, and the uids the provisioning file gives the datasources: the
# datasource variables default to these, so provisioned dashboards work without a click.
PROMETHEUS_TYPE = "prometheus"
POSTGRES_TYPE = "grafana-postgresql-datasource"
DEFAULT_PROMETHEUS_UID = "trainvitals-prometheus"
DEFAULT_POSTGRES_UID = "trainvitals-postgres"
PROMETHEUS_DS = common_m.DataSourceRef(type_val=PROMETHEUS_TYPE, uid="${datasource}")
POSTGRES_DS = common_m.DataSourceRef(type_val=POSTGRES_TYPE, uid="${sql_datasource}")

# The scrape job of dashboards/prometheus/prometheus.yml (the alert rules say the same name).
SCRAPE_JOB = "trainvitals"

# Units: Grafana unit ids, or its custom `suffix:` form where Grafana has none.
SECONDS = "s"
RATIO = "percentunit"
COUNT = "none"
BITS = "suffix: bits"
TOKENS_PER_SECOND = "suffix: tok/s"
STEPS_PER_SECOND = "suffix: steps/s"
RECORDS_PER_SECOND = "suffix: records/s"
BATCHES_PER_SECOND = "suffix: batches/s"
REQUESTS_PER_SECOND = "reqps"
ERRORS_PER_SECOND = "suffix: errors/s"
RECORDS = "suffix: records"
TIMES = "suffix:x"

DEFAULT_HEIGHT = 8


# -- dashboards, variables and links ---------------------------------------------------------


def dashboard(
    title: str, *, uid: str, description: str, time_from: str, variables: Sequence[Any]
) -> dash_b.Dashboard:
    """The settings every trainvitals dashboard shares (tag, refresh, crosshair, links), with its
    own title, uid, default time range and variables in the order given."""
    board = (
        dash_b.Dashboard(title)
        .uid(uid)
        .description(description)
        .tags([TAG])
        .editable()
        .refresh("30s")
        .time(time_from, "now")
        .timezone("browser")
        .tooltip(dash_m.DashboardCursorSync.CROSSHAIR)
    )
    for variable in variables:
        board = board.with_variable(variable)
    return board.links(dashboard_links())


def prometheus_variable() -> dash_b.DatasourceVariable:
    return (
        dash_b.DatasourceVariable("datasource")
        .label("Prometheus")
        .type(PROMETHEUS_TYPE)
        .current(dash_m.VariableOption(text=DEFAULT_PROMETHEUS_UID, value=DEFAULT_PROMETHEUS_UID))
    )


def postgres_variable() -> dash_b.DatasourceVariable:
    return (
        dash_b.DatasourceVariable("sql_datasource")
        .label("PostgreSQL")
        .type(POSTGRES_TYPE)
        .current(dash_m.VariableOption(text=DEFAULT_POSTGRES_UID, value=DEFAULT_POSTGRES_UID))
    )


def project_variable() -> dash_b.QueryVariable:
    query = "label_values(trainvitals_run_info, project)"
    return (
        dash_b.QueryVariable("project")
        .label("Project")
        .datasource(PROMETHEUS_DS)
        .query(query)
        .definition(query)
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
        .include_all(True)
        .all_value(".*")
        .current(dash_m.VariableOption(text="All", value="$__all"))
    )


def run_variable() -> dash_b.QueryVariable:
    query = 'label_values(trainvitals_run_info{project=~"$project"}, run)'
    return (
        dash_b.QueryVariable("run")
        .label("Run")
        .datasource(PROMETHEUS_DS)
        .query(query)
        .definition(query)
        .refresh(dash_m.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(dash_m.VariableSort.ALPHABETICAL_ASC)
    )


def dashboard_links() -> list[cog_builder.Builder[dash_m.DashboardLink]]:
    """The other trainvitals dashboards, keeping the time range and the variables."""
    return [
        dash_b.DashboardLink("trainvitals")
        .type(dash_m.DashboardLinkType.DASHBOARDS)
        .tags([TAG])
        .as_dropdown(True)
        .include_vars(True)
        .keep_time(True)
    ]


def run_dashboard_url(run: str) -> str:
    """URL of the Run dashboard for `run` (a Grafana data-link expression such as
    `${__value.raw}`), keeping the datasource, the project and the time range."""
    return (
        f"/d/{RUN_UID}/trainvitals-run?var-run={run}"
        "&${datasource:queryparam}&${project:queryparam}&${__url_time_range}"
    )


def run_data_link(run: str) -> cog_builder.Builder[dash_m.DashboardLink]:
    """A data link to the Run dashboard; `run` is the data-link expression naming the run."""
    return dash_b.DashboardLink(f"Open run {run}").type(dash_m.DashboardLinkType.LINK).url(run_dashboard_url(run))


NODE_DASHBOARD_VARIABLE = "node_dashboard_url"
# NVIDIA's DCGM exporter dashboard (grafana.com 12239) as imported, filtered by its Hostname label;
# a site with another node dashboard sets the variable (provisioning, or ?var-node_dashboard_url=).
DEFAULT_NODE_DASHBOARD_URL = "/d/Oxed_c6Wz/nvidia-dcgm-exporter-dashboard?var-Hostname="


def node_dashboard_variable() -> dash_b.TextBoxVariable:
    return (
        dash_b.TextBoxVariable(NODE_DASHBOARD_VARIABLE)
        .label("Node dashboard URL (host appended)")
        .default_value(DEFAULT_NODE_DASHBOARD_URL)
        .current(dash_m.VariableOption(text=DEFAULT_NODE_DASHBOARD_URL, value=DEFAULT_NODE_DASHBOARD_URL))
        .hide(dash_m.VariableHide.HIDE_VARIABLE)
    )


def node_dashboard_link() -> cog_builder.Builder[dash_m.DashboardLink]:
    """A data link from a `host` field to the node's hardware dashboard (the variable's URL + host)."""
    return (
        dash_b.DashboardLink("Open node ${__data.fields.host}")
        .type(dash_m.DashboardLinkType.LINK)
        .url(f"${{{NODE_DASHBOARD_VARIABLE}}}${{__data.fields.host}}&${{__url_time_range}}")
    )


# -- queries ---------------------------------------------------------------------------------


def prom(
    expr: str,
    *,
    legend: str = "",
    ref: str = "A",
    instant: bool = False,
    table: bool = False,
) -> prom_b.Dataquery:
    """A Prometheus query on the dashboard's datasource variable."""
    q = prom_b.Dataquery().expr(expr).ref_id(ref).datasource(PROMETHEUS_DS)
    if legend:
        q = q.legend_format(legend)
    if instant:
        q = q.instant()
    if table:
        q = q.format(PromQueryFormat.TABLE)
    return q


class SqlQuery(cog_variants.Dataquery):
    """A query of Grafana's built-in PostgreSQL datasource (the SDK ships no model for it)."""

    def __init__(self, raw_sql: str, *, ref: str, fmt: Literal["time_series", "table"]) -> None:
        self.raw_sql = raw_sql
        self.ref = ref
        self.fmt = fmt

    def to_json(self) -> dict[str, object]:
        return {
            "datasource": POSTGRES_DS.to_json(),
            "editorMode": "code",
            "format": self.fmt,
            "rawQuery": True,
            "rawSql": self.raw_sql,
            "refId": self.ref,
        }


class Sql(cog_builder.Builder[cog_variants.Dataquery]):
    """Builder for SqlQuery, so it goes wherever the SDK takes a query builder."""

    def __init__(self, raw_sql: str, *, ref: str = "A", fmt: Literal["time_series", "table"] = "table") -> None:
        self._query = SqlQuery(raw_sql, ref=ref, fmt=fmt)

    def build(self) -> cog_variants.Dataquery:
        return self._query


# -- field config pieces -----------------------------------------------------------------------


def thresholds(base: str, *steps: tuple[float, str]) -> dash_b.ThresholdsConfig:
    """Absolute thresholds: `base` colour below the first step, then (value, colour) pairs."""
    return (
        dash_b.ThresholdsConfig()
        .mode(dash_m.ThresholdsMode.ABSOLUTE)
        .steps([dash_m.Threshold(value=None, color=base), *(dash_m.Threshold(value=v, color=c) for v, c in steps)])
    )


def value_text(mapping: dict[str, tuple[str, str]]) -> list[dash_m.ValueMapping]:
    """Value mappings {value: (text, colour)}."""
    return [
        dash_m.ValueMap(
            options={
                k: dash_m.ValueMappingResult(text=t, color=c, index=i) for i, (k, (t, c)) in enumerate(mapping.items())
            }
        )
    ]


def transformation(kind: str, options: dict[str, Any] | None = None) -> dash_m.DataTransformerConfig:
    return dash_m.DataTransformerConfig(id_val=kind, options=options or {})


def organize(rename: dict[str, str], exclude: Sequence[str] = ()) -> dash_m.DataTransformerConfig:
    """Rename table columns and drop the ones a reader does not need."""
    return transformation(
        "organize",
        {"excludeByName": dict.fromkeys(exclude, True), "renameByName": rename, "indexByName": {}},
    )


# -- panels ------------------------------------------------------------------------------------


def row(row_id: int, title: str) -> dash_b.Row:
    return dash_b.Row(title).id(row_id)


def timeseries(
    panel_id: int,
    title: str,
    *,
    unit: str,
    description: str,
    targets: Sequence[cog_builder.Builder[cog_variants.Dataquery]],
    w: int = 12,
    h: int = DEFAULT_HEIGHT,
    min_value: float | None = None,
    bars: bool = False,
    threshold: tuple[str, float, str] | None = None,
    links: Sequence[cog_builder.Builder[dash_m.DashboardLink]] = (),
) -> timeseries_b.Panel:
    """A time series panel. `threshold` = (colour below, value, colour above) draws a line at
    the value (the 0-bit line of FP8 headroom, an alert's limit)."""
    panel = (
        timeseries_b.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROMETHEUS_DS)
        .targets(list(targets))
        .span(w)
        .height(h)
        .fill_opacity(10)
        .line_width(1)
        .show_points(common_m.VisibilityMode.NEVER)
        .legend(
            common_b.VizLegendOptions()
            .display_mode(common_m.LegendDisplayMode.LIST)
            .placement(common_m.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_b.VizTooltipOptions().mode(common_m.TooltipDisplayMode.MULTI).sort(common_m.SortOrder.DESCENDING)
        )
    )
    if min_value is not None:
        panel = panel.min(min_value)
    if bars:
        panel = panel.draw_style(common_m.GraphDrawStyle.BARS).fill_opacity(60)
    if threshold is not None:
        below, value, above = threshold
        panel = panel.thresholds(thresholds(below, (value, above))).thresholds_style(
            common_b.GraphThresholdsStyleConfig().mode(common_m.GraphThresholdsStyleMode.DASHED)
        )
    if links:
        panel = panel.data_links(list(links))
    return panel


def stat(
    panel_id: int,
    title: str,
    *,
    unit: str,
    description: str,
    targets: Sequence[cog_builder.Builder[cog_variants.Dataquery]],
    w: int = 6,
    h: int = 4,
    text_mode: common_m.BigValueTextMode = common_m.BigValueTextMode.VALUE,
    color_thresholds: dash_b.ThresholdsConfig | None = None,
    mappings: list[dash_m.ValueMapping] | None = None,
    no_value: str | None = None,
) -> stat_b.Panel:
    """A single-value panel showing the newest value of each query."""
    panel = (
        stat_b.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROMETHEUS_DS)
        .targets(list(targets))
        .span(w)
        .height(h)
        .graph_mode(common_m.BigValueGraphMode.NONE)
        .color_mode(common_m.BigValueColorMode.VALUE)
        .text_mode(text_mode)
        .reduce_options(common_b.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(color_thresholds or thresholds("green"))
    )
    if mappings:
        panel = panel.mappings(mappings)
    if no_value is not None:
        panel = panel.no_value(no_value)
    return panel


def table(
    panel_id: int,
    title: str,
    *,
    unit: str,
    description: str,
    targets: Sequence[cog_builder.Builder[cog_variants.Dataquery]],
    transformations: Sequence[dash_m.DataTransformerConfig],
    w: int = 12,
    h: int = DEFAULT_HEIGHT,
    sort_by: tuple[str, bool] | None = None,
    links: Sequence[cog_builder.Builder[dash_m.DashboardLink]] = (),
) -> table_b.Panel:
    """A table of instant queries joined on their labels; `sort_by` is (column, descending).

    One unit for every column: per-column units need field overrides, whose matcher options and
    values the Grafana schemas type as objects (tests/dashboards validates against them), so
    the column names carry the units instead."""
    panel = (
        table_b.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROMETHEUS_DS)
        .targets(list(targets))
        .transformations(list(transformations))
        .span(w)
        .height(h)
        .cell_height(common_m.TableCellHeight.SM)
        .filterable(False)
    )
    if sort_by is not None:
        panel = panel.sort_by([common_b.TableSortByFieldState().display_name(sort_by[0]).desc(sort_by[1])])
    if links:
        panel = panel.data_links(list(links))
    return panel


def state_timeline(
    panel_id: int,
    title: str,
    *,
    unit: str,
    description: str,
    targets: Sequence[cog_builder.Builder[cog_variants.Dataquery]],
    mappings: list[dash_m.ValueMapping],
    w: int = 24,
    h: int = DEFAULT_HEIGHT,
) -> statetimeline_b.Panel:
    return (
        statetimeline_b.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(PROMETHEUS_DS)
        .targets(list(targets))
        .mappings(mappings)
        .span(w)
        .height(h)
        .show_value(common_m.VisibilityMode.NEVER)
        .merge_values(True)
        .row_height(0.8)
        .legend(common_b.VizLegendOptions().display_mode(common_m.LegendDisplayMode.LIST).show_legend(False))
    )


def sql_heatmap(
    panel_id: int,
    title: str,
    *,
    unit: str,
    description: str,
    sql: str,
    w: int = 24,
    h: int = 10,
) -> heatmap_b.Panel:
    """A heatmap over pre-bucketed rows from the PostgreSQL datasource (no calculation in
    Grafana): each series of the SQL result is one row of cells."""
    return (
        heatmap_b.Panel()
        .id(panel_id)
        .title(title)
        .description(description)
        .unit(unit)
        .datasource(POSTGRES_DS)
        .with_target(Sql(sql, fmt="time_series"))
        .span(w)
        .height(h)
        .calculate(False)
        .color(
            heatmap_b.HeatmapColorOptions()
            .mode(heatmap_m.HeatmapColorMode.SCHEME)
            .scheme("Turbo")
            .scale(heatmap_m.HeatmapColorScale.EXPONENTIAL)
            .exponent(0.5)
            .steps(64)
            .reverse(False)
        )
        .y_axis(heatmap_b.YAxisConfig().axis_label("rank"))
        .cell_values(heatmap_b.CellValues().unit(unit))
        .rows_frame(heatmap_b.RowsHeatmapOptions().layout(common_m.HeatmapCellLayout.AUTO).value("step time"))
        .show_legend()
        .tooltip(heatmap_b.HeatmapTooltip().mode(common_m.TooltipDisplayMode.SINGLE).y_histogram(False))
    )


# -- annotations -------------------------------------------------------------------------------


def builtin_annotation() -> dash_b.AnnotationQuery:
    """Grafana's own annotations and alerts (every dashboard has it)."""
    return (
        dash_b.AnnotationQuery()
        .name("Annotations & Alerts")
        .datasource(common_m.DataSourceRef(type_val="grafana", uid="-- Grafana --"))
        .enable(True)
        .hide(True)
        .icon_color("rgba(0, 211, 255, 1)")
        .type("dashboard")
        .built_in(1)
    )


def prom_annotation(name: str, expr: str, *, color: str, title: str, text: str) -> dash_b.AnnotationQuery:
    """A Prometheus annotation: one event wherever `expr` returns a series (Grafana joins
    consecutive points into a region)."""
    return (
        dash_b.AnnotationQuery()
        .name(name)
        .datasource(PROMETHEUS_DS)
        .enable(True)
        .hide(False)
        .icon_color(color)
        .expr(expr)
        .step("$__interval")
        .title_format(title)
        .text_format(text)
    )


# -- output ------------------------------------------------------------------------------------


def render(board: dash_m.Dashboard) -> str:
    """The dashboard as Grafana JSON: sorted keys and a trailing newline, so that regenerating
    gives byte-identical files and a diff shows only real changes."""
    return json.dumps(json.loads(JSONEncoder().encode(board)), sort_keys=True, indent=2) + "\n"
