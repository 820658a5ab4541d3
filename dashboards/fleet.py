"""The Fleet dashboard: every live run of a project on one screen, each linking to its Run
dashboard.

Every query keeps to the runs of `$project` by joining on `trainvitals_run_info` (the only
family with a `project` label), and aggregates with `max by (run)`: collector replicas sharing
one database serve identical series, which must count once.
"""

from __future__ import annotations

from grafana_foundation_sdk.models import dashboard as dash_m

from trainvitals.dashboards import panels as p

IN_PROJECT = 'on (run) trainvitals_run_info{project=~"$project"}'
OPEN_PAGES = 'count by (run) (max by (run, kind, subject_kind, subject) (trainvitals_finding_active{severity="page"}))'
OPEN_TICKETS = (
    'count by (run) (max by (run, kind, subject_kind, subject) (trainvitals_finding_active{severity="ticket"}))'
)
# TrainvitalsRunStalled's condition: 10x the step time, at least 120 s (120 s alone before a step time).
STALLED = (
    "max by (run) (trainvitals_run_seconds_since_last_step)"
    ' > on (run) (clamp_min(10 * max by (run) (trainvitals_run_rank_step_seconds{stat="max"}), 120)'
    " or on (run) (0 * max by (run) (trainvitals_run_seconds_since_last_step) + 120))"
)


def _in_project(expr: str) -> str:
    return f"{expr} and {IN_PROJECT}"


def _per_run(metric: str) -> str:
    return _in_project(f"max by (run) ({metric})")


def build() -> dash_m.Dashboard:
    board = p.dashboard(
        "trainvitals / Fleet",
        uid=p.FLEET_UID,
        description="Every live training run of a project: is it stepping, how fast, and is anything paging.",
        time_from="now-6h",
        variables=[p.prometheus_variable(), p.project_variable()],
    ).annotations(
            [
                p.builtin_annotation(),
                p.prom_annotation(
                    "Firing alerts",
                    _in_project('ALERTS{alertstate="firing", run!=""}'),
                    color="red",
                    title="{{alertname}}",
                    text="run {{run}}: {{severity}} {{subject_kind}} {{subject}}",
                ),
            ]
    )
    board = board.with_row(p.row(100, "Fleet at a glance"))
    board = board.with_panel(
        p.stat(
            101,
            "Live runs",
            unit=p.COUNT,
            description="Live runs: running and seen within the idle window, or finished within the grace period. "
            "Counts the runs the collector exports plus those its per-project and per-scrape caps leave out "
            "(trainvitals_runs_omitted), which the other panels do not show.",
            targets=[
                p.prom(
                    'count(max by (run) (trainvitals_run_info{project=~"$project"}))'
                    ' + (max(sum by (instance) (trainvitals_runs_omitted{project=~"$project"})) or vector(0))',
                    instant=True,
                )
            ],
            no_value="0",
        )
    )
    board = board.with_panel(
        p.stat(
            102,
            "Runs stalled",
            unit=p.COUNT,
            description="Running runs whose newest step is older than 10x their slowest rank's step time (at least "
            "120 s): the TrainvitalsRunStalled condition, before its 2 minutes of persistence.",
            targets=[
                p.prom(
                    f'count(({STALLED}) and on (run) trainvitals_run_info{{project=~"$project", status="running"}})'
                    " or vector(0)",
                    instant=True,
                )
            ],
            no_value="0",
            color_thresholds=p.thresholds("green", (1, "red")),
        )
    )
    board = board.with_panel(
        p.stat(
            103,
            "Open pages",
            unit=p.COUNT,
            description="Open detector findings of severity page, over all live runs of the project.",
            targets=[p.prom(f"sum({_in_project(OPEN_PAGES)}) or vector(0)", instant=True)],
            no_value="0",
            color_thresholds=p.thresholds("green", (1, "red")),
        )
    )
    board = board.with_panel(
        p.stat(
            104,
            "Open tickets",
            unit=p.COUNT,
            description="Open detector findings of severity ticket, over all live runs of the project.",
            targets=[p.prom(f"sum({_in_project(OPEN_TICKETS)}) or vector(0)", instant=True)],
            no_value="0",
            color_thresholds=p.thresholds("green", (1, "orange")),
        )
    )

    board = board.with_row(p.row(200, "Live runs"))
    columns = {
        "Value #B": "complete step",
        "Value #C": "s since last step",
        "Value #D": "tokens/s",
        "Value #E": "MFU %",
        "Value #F": "open pages",
        "Value #G": "ranks reporting",
        "Value #H": "world size",
    }
    runs_table = p.table(
        201,
        "Live runs",
        unit=p.COUNT,
        description="One row per live run: status, newest complete step, seconds since any rank finished a step, "
        "tokens/s, measured MFU in percent, open pages, and the ranks in the complete step next to the world "
        "size. Click a row for the run's dashboard.",
        targets=[
            p.prom(
                'max by (run, project, status) (trainvitals_run_info{project=~"$project"})',
                ref="A",
                instant=True,
                table=True,
            ),
            p.prom(_per_run("trainvitals_run_complete_step"), ref="B", instant=True, table=True),
            p.prom(_per_run("trainvitals_run_seconds_since_last_step"), ref="C", instant=True, table=True),
            p.prom(_per_run("trainvitals_run_tokens_per_second"), ref="D", instant=True, table=True),
            p.prom(f"100 * {_per_run('trainvitals_run_mfu_ratio')}", ref="E", instant=True, table=True),
            p.prom(
                f"({OPEN_PAGES} or 0 * max by (run) (trainvitals_run_info)) and {IN_PROJECT}",
                ref="F",
                instant=True,
                table=True,
            ),
            p.prom(_per_run("trainvitals_run_ranks_reporting"), ref="G", instant=True, table=True),
            p.prom(_per_run("trainvitals_run_world_size_ranks"), ref="H", instant=True, table=True),
        ],
        transformations=[p.transformation("merge"), p.organize(columns, exclude=("Time", "Value #A"))],
        w=24,
        h=10,
        sort_by=("s since last step", True),
        links=[p.run_data_link("${__data.fields.run}")],
    )
    board = board.with_panel(runs_table)

    board = board.with_row(p.row(300, "Across runs"))
    link = [p.run_data_link("${__field.labels.run}")]
    board = board.with_panel(
        p.timeseries(
            301,
            "Tokens per second by run",
            unit=p.TOKENS_PER_SECOND,
            description="Job tokens per second of each run (tokens of the complete step / slowest rank's step time).",
            targets=[p.prom(_per_run("trainvitals_run_tokens_per_second"), legend="{{run}}")],
            links=link,
        )
    )
    board = board.with_panel(
        p.timeseries(
            302,
            "MFU by run",
            unit=p.RATIO,
            description="Measured model FLOPs utilisation of each run over its last 20 reduced steps.",
            targets=[p.prom(_per_run("trainvitals_run_mfu_ratio"), legend="{{run}}")],
            min_value=0,
            links=link,
        )
    )
    board = board.with_panel(
        p.timeseries(
            303,
            "Seconds since last step by run",
            unit=p.SECONDS,
            description="Seconds since the collector last stored a step record, per run: a run that stops stepping "
            "climbs here (TrainvitalsRunStalled fires past 10x its step time, at least 120 s).",
            targets=[p.prom(_per_run("trainvitals_run_seconds_since_last_step"), legend="{{run}}")],
            min_value=0,
            threshold=("green", 120, "red"),
            links=link,
        )
    )
    board = board.with_panel(
        p.timeseries(
            304,
            "Open findings by run and severity",
            unit=p.COUNT,
            description="Open detector findings per run and severity (page, ticket, info).",
            targets=[
                p.prom(
                    _in_project(
                        "count by (run, severity) "
                        "(max by (run, kind, severity, subject_kind, subject) (trainvitals_finding_active))"
                    ),
                    legend="{{run}} {{severity}}",
                )
            ],
            min_value=0,
            links=link,
        )
    )
    return board.build()
