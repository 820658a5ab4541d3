"""The Run dashboard: one training run, row by row from "is it healthy" down to the collector
that watches it.

Rows: health at a glance (100), throughput and MFU (200), convergence (300), stragglers (400,
with the rank x step heatmap from PostgreSQL), FP8 (500), findings (600), checkpoints (700),
the collector itself (800). Panel ids are fixed (row id + n): alerts link to them.

Queries select `{run="$run"}` and aggregate with `max`/`max by`: collector replicas sharing one
database serve identical series, which must count once (and a label-free result joins with
another one without `on (...)` clauses).

Per-process families of the collector (request latency, refusals, write queue) are summed over
instances instead: each process counts its own requests.
"""

from __future__ import annotations

from grafana_foundation_sdk.builders import dashboard as dash_b
from grafana_foundation_sdk.cog import builder as cog_builder
from grafana_foundation_sdk.models import common as common_m
from grafana_foundation_sdk.models import dashboard as dash_m

from trainvitals.dashboards import panels as p

R = 'run="$run"'
# New findings per interval by kind and severity. A (kind, severity) series only exists from its
# first finding on, and increase() does not count a series' first sample: when a kind's first
# findings all arrive in one scrape, increase() says 0. So a series that did not exist an
# interval ago counts with its whole value (it was 0 before).
_FINDINGS = f"trainvitals_findings_total{{{R}}}"
_NEW_FINDINGS = (
    f"max by (kind, severity) ((increase({_FINDINGS}[$__rate_interval]) > 0) "
    f"or ({_FINDINGS} unless {_FINDINGS} offset $__rate_interval))"
)


def _m(metric: str, *, by: str = "", where: str = "") -> str:
    """`max [by (...)] (metric{run="$run", where})`: one series per label set across replicas."""
    selector = f"{metric}{{{R}{', ' + where if where else ''}}}"
    return f"max by ({by}) ({selector})" if by else f"max({selector})"


STEP_MAX = _m("trainvitals_run_rank_step_seconds", where='stat="max"')
RUNNING = _m("trainvitals_run_info", where='status="running"')
STEP_P50 = _m("trainvitals_run_rank_step_seconds", where='stat="p50"')
STEP_P99 = _m("trainvitals_run_rank_step_seconds", where='stat="p99"')
# Delivered but not yet reduced steps, in seconds of training (TrainvitalsAnalysisBehind's quantity).
ANALYSIS_LAG = f"({_m('trainvitals_run_latest_step')} - {_m('trainvitals_run_complete_step')}) * {STEP_P50}"

# Per-rank step time from the collector's own `steps` table (Prometheus keeps only the top-k
# ranks). Grafana expands the macros: ${run:sqlstring} quotes and escapes the run id,
# $__unixEpochFilter keeps the dashboard's time range (ts is epoch seconds), and
# $__unixEpochGroupAlias buckets by the panel's interval so cells stay within the pixels. Cost:
# every step row of the run in the range, sorted once for DISTINCT ON (index ix_steps_run_step_rank_ts
# finds the run); a week of a 16k-rank job is a post-mortem query, not a 30 s refresh. The table
# holds the run under its key (service/store/run_keys.py): the bare id for the default project,
# "<project>/<run>" for another, found through `runs`. Like the Prometheus panels, which select by
# the run label alone, it shows two projects' runs of the same id together.
RANK_STEP_HEATMAP_SQL = """\
SELECT
  $__unixEpochGroupAlias(ts, $__interval),
  lpad(rank::text, 6, '0') AS metric,
  max(step_seconds) AS value
FROM (
  -- a relaunch repeats steps: the newest incarnation of each (rank, step) wins
  SELECT DISTINCT ON (rank, step) rank, ts, step_seconds
  FROM steps
  WHERE run_id IN (SELECT run_id FROM runs WHERE run_id IN (${run:sqlstring}, project || '/' || ${run:sqlstring}))
    AND $__unixEpochFilter(ts)
  ORDER BY rank, step, incarnation DESC
) AS newest
GROUP BY 1, 2
ORDER BY 1, 2"""


def _annotations() -> list[cog_builder.Builder[dash_m.AnnotationQuery]]:
    return [
        p.builtin_annotation(),
        p.prom_annotation(
            "Firing alerts",
            f'ALERTS{{alertstate="firing", {R}}}',
            color="red",
            title="{{alertname}}",
            text="{{severity}}: {{kind}} {{subject_kind}} {{subject}}",
        ),
        p.prom_annotation(
            "Findings raised",
            _NEW_FINDINGS,
            color="orange",
            title="{{kind}}",
            text="new {{severity}} finding",
        ),
        p.prom_annotation(
            "Checkpoint persisted",
            f"changes(trainvitals_checkpoint_last_persisted_step{{{R}}}[$__rate_interval]) > 0",
            color="green",
            title="checkpoint persisted",
            text="a newer checkpoint generation was persisted",
        ),
        p.prom_annotation(
            "Restarts, resumes and rollbacks",
            f'max by (event) (increase(trainvitals_run_events_total{{{R}, event=~"restart|resume|rollback"}}'
            "[$__rate_interval])) > 0",
            color="blue",
            title="{{event}}",
            text="a rank started again, resumed from a checkpoint or rolled back",
        ),
        p.prom_annotation(
            "Ranks lost",
            f'max(increase(trainvitals_run_events_total{{{R}, event="rank_lost"}}[$__rate_interval])) > 0',
            color="dark-red",
            title="ranks lost",
            text="rank incarnations ended without a clean stop (a crash, a kill, or a relaunch that took them down)",
        ),
        p.prom_annotation(
            "Ranks missing from the complete step",
            f"{_m('trainvitals_run_ranks_reporting')} < {_m('trainvitals_run_world_size_ranks')}",
            color="purple",
            title="ranks missing",
            text="the complete step has fewer ranks than the world size (a rank lost, or late past the settle time)",
        ),
    ]


def build() -> dash_m.Dashboard:
    board = p.dashboard(
        "trainvitals / Run",
        uid=p.RUN_UID,
        description="One training run: health, throughput, convergence, stragglers, FP8, findings, checkpoints.",
        time_from="now-3h",
        variables=[
            p.prometheus_variable(),
            p.postgres_variable(),
            p.project_variable(),
            p.run_variable(),
            p.node_dashboard_variable(),
        ],
    ).annotations(_annotations())
    board = _health(board)
    board = _throughput(board)
    board = _convergence(board)
    board = _stragglers(board)
    board = _fp8(board)
    board = _findings(board)
    board = _checkpoints(board)
    board = _collector(board)
    return board.build()


def _health(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(100, "Health at a glance"))
    board = board.with_panel(
        p.stat(
            101,
            "Status",
            unit=p.COUNT,
            description="The run's status as registered: running, or finished (rank 0 closed its agent).",
            targets=[p.prom(_m("trainvitals_run_info", by="status"), legend="{{status}}", instant=True)],
            w=4,
            text_mode=common_m.BigValueTextMode.NAME,
        )
    )
    board = board.with_panel(
        p.stat(
            102,
            "Stalled?",
            unit=p.COUNT,
            description="Is the run stalled: running, and no step for more than 10x the slowest rank's step time "
            "(at least 120 s; 120 s before its first reduced step). TrainvitalsRunStalled fires when this holds for "
            "2 minutes. A run that is not running (finished or failed: exported for a few minutes after) reads "
            "not running.",
            targets=[
                p.prom(
                    f"(({_m('trainvitals_run_seconds_since_last_step')}"
                    f" > bool (clamp_min(10 * {STEP_MAX}, 120) or vector(120)))"
                    f" and {RUNNING}) or vector(-1)",
                    instant=True,
                )
            ],
            w=4,
            mappings=p.value_text({"-1": ("not running", "blue"), "0": ("stepping", "green"), "1": ("STALLED", "red")}),
        )
    )
    board = board.with_panel(
        p.stat(
            103,
            "Seconds since last step",
            unit=p.SECONDS,
            description="Seconds since the collector last stored a step record of this run, on the collector's "
            "clock (before the first, since the newest step's end time). The age TrainvitalsRunStalled judges.",
            targets=[p.prom(_m("trainvitals_run_seconds_since_last_step"), instant=True)],
            w=4,
            color_thresholds=p.thresholds("green", (60, "orange"), (120, "red")),
        )
    )
    board = board.with_panel(
        p.stat(
            104,
            "Ranks reporting / world size",
            unit=p.COUNT,
            description="Ranks in the complete step, next to the ranks declared at registration: fewer means a rank "
            "is lost or later than the settle time.",
            targets=[
                p.prom(_m("trainvitals_run_ranks_reporting"), legend="reporting", ref="A", instant=True),
                p.prom(_m("trainvitals_run_world_size_ranks"), legend="world size", ref="B", instant=True),
            ],
            w=4,
            text_mode=common_m.BigValueTextMode.VALUE_AND_NAME,
        )
    )
    board = board.with_panel(
        p.stat(
            105,
            "Complete vs latest step",
            unit=p.COUNT,
            description="The newest step reduced across ranks (the per-step values on this dashboard are of it), "
            "the highest step any rank delivered, and the gap between them.",
            targets=[
                p.prom(_m("trainvitals_run_complete_step"), legend="complete", ref="A", instant=True),
                p.prom(_m("trainvitals_run_latest_step"), legend="latest", ref="B", instant=True),
                p.prom(
                    f"{_m('trainvitals_run_latest_step')} - {_m('trainvitals_run_complete_step')}",
                    legend="not yet reduced",
                    ref="C",
                    instant=True,
                ),
            ],
            w=4,
            text_mode=common_m.BigValueTextMode.VALUE_AND_NAME,
        )
    )
    board = board.with_panel(
        p.stat(
            106,
            "Open findings by severity",
            unit=p.COUNT,
            description="Open detector findings of this run by severity; the Findings row says which.",
            targets=[
                p.prom(
                    "count by (severity) "
                    f"({_m('trainvitals_finding_active', by='kind, severity, subject_kind, subject')})",
                    legend="{{severity}}",
                    instant=True,
                )
            ],
            w=4,
            text_mode=common_m.BigValueTextMode.VALUE_AND_NAME,
            color_thresholds=p.thresholds("green", (1, "red")),
            no_value="none open",
        )
    )
    return board


def _throughput(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(200, "Throughput and MFU"))
    board = board.with_panel(
        p.timeseries(
            201,
            "Tokens per second",
            unit=p.TOKENS_PER_SECOND,
            description="Job tokens per second: tokens of the complete step over the slowest rank's step time "
            "(synchronous data parallelism moves at the slowest rank's pace).",
            targets=[p.prom(_m("trainvitals_run_tokens_per_second"), legend="tokens/s")],
            min_value=0,
        )
    )
    board = board.with_panel(
        p.timeseries(
            202,
            "Steps per second",
            unit=p.STEPS_PER_SECOND,
            description="How fast the complete step advances (deriv of the step gauge: a rollback shows as a dip, "
            "not as a counter reset).",
            targets=[
                p.prom(
                    f"max(deriv(trainvitals_run_complete_step{{{R}}}[$__rate_interval]))",
                    legend="steps/s",
                )
            ],
            min_value=0,
        )
    )
    board = board.with_panel(
        p.timeseries(
            203,
            "MFU: measured vs predicted",
            unit=p.RATIO,
            description="Measured MFU over the last 20 reduced steps against the cost model's prediction for the "
            "run's parallelism config, with the prediction interval (predicted low / high; absent when the run "
            "declares tags.expected_mfu). Measured below the band's low end is a real gap, not model error.",
            targets=[
                p.prom(_m("trainvitals_run_mfu_ratio"), legend="measured", ref="A"),
                p.prom(_m("trainvitals_run_mfu_expected_ratio"), legend="predicted", ref="B"),
                p.prom(
                    _m("trainvitals_run_mfu_expected_band_ratio", by="bound"), legend="predicted {{bound}}", ref="C"
                ),
            ],
            min_value=0,
        )
    )
    board = board.with_panel(
        p.timeseries(
            204,
            "MFU gap",
            unit=p.RATIO,
            description="1 - measured / predicted MFU: the share of the predicted throughput the run is not "
            "getting (TrainvitalsMfuGap's magnitude; the detector pages on a sustained gap).",
            targets=[
                p.prom(
                    f"1 - {_m('trainvitals_run_mfu_ratio')} / {_m('trainvitals_run_mfu_expected_ratio')}",
                    legend="gap",
                )
            ],
            threshold=("green", 0.2, "orange"),
        )
    )
    return board


def _convergence(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(300, "Convergence"))
    board = board.with_panel(
        p.timeseries(
            301,
            "Loss",
            unit=p.COUNT,
            description="Mean training loss over the ranks that reported a finite loss, at the complete step.",
            targets=[p.prom(_m("trainvitals_run_loss"), legend="loss")],
        )
    )
    board = board.with_panel(
        p.timeseries(
            302,
            "Gradient norm",
            unit=p.COUNT,
            description="Global L2 gradient norm at the complete step (the job's pre-clip total when reported, "
            "else the square root of the summed owned squares).",
            targets=[p.prom(_m("trainvitals_run_grad_norm"), legend="grad norm")],
        )
    )
    board = board.with_panel(
        p.timeseries(
            303,
            "Parameters with non-finite gradients",
            unit=p.COUNT,
            description="Parameters whose gradient held a NaN or inf, and ranks whose loss was NaN or inf, at the "
            "complete step; any non-zero bar is a problem (TrainvitalsNonFiniteGradients pages on both).",
            targets=[
                p.prom(_m("trainvitals_run_grad_nonfinite_params"), legend="non-finite params", ref="A"),
                p.prom(_m("trainvitals_run_loss_nonfinite_ranks"), legend="ranks with non-finite loss", ref="B"),
            ],
            min_value=0,
            bars=True,
        )
    )
    board = board.with_panel(
        p.timeseries(
            304,
            "Top 10 layer gradient norms",
            unit=p.COUNT,
            description="The ten parameter groups (layers) with the largest gradient norm at each point: which "
            "layer drives a spike or a drift.",
            targets=[p.prom(f"topk(10, {_m('trainvitals_grad_group_norm', by='group')})", legend="{{group}}")],
        )
    )
    return board


def _stragglers(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(400, "Stragglers"))
    board = board.with_panel(
        p.timeseries(
            401,
            "Step time across ranks",
            unit=p.SECONDS,
            description="Distribution of step time across ranks at the complete step: min, p50, p90, p99, max.",
            targets=[p.prom(_m("trainvitals_run_rank_step_seconds", by="stat"), legend="{{stat}}")],
            min_value=0,
        )
    )
    board = board.with_panel(
        p.timeseries(
            402,
            "Spread across ranks",
            unit=p.TIMES,
            description="Slowest and p99 rank over the median rank: 1x is perfectly even; a straggler lifts max/p50 "
            "while p99/p50 stays low.",
            targets=[
                p.prom(f"{STEP_MAX} / {STEP_P50}", legend="max / p50", ref="A"),
                p.prom(f"{STEP_P99} / {STEP_P50}", legend="p99 / p50", ref="B"),
            ],
        )
    )
    board = board.with_panel(
        p.timeseries(
            403,
            "Step time vs collective wait vs data wait (median rank)",
            unit=p.SECONDS,
            description="Median over ranks of step time, of compute time, of time blocked in gradient collectives "
            "and of time waiting for input: victims of a straggler wait, the straggler computes.",
            targets=[
                p.prom(STEP_P50, legend="step (p50)", ref="A"),
                p.prom(_m("trainvitals_run_rank_compute_seconds"), legend="compute (p50)", ref="D"),
                p.prom(_m("trainvitals_run_rank_wait_seconds"), legend="collective wait (p50)", ref="B"),
                p.prom(_m("trainvitals_run_rank_data_seconds"), legend="data wait (p50)", ref="C"),
            ],
            min_value=0,
        )
    )
    board = board.with_panel(
        p.timeseries(
            404,
            "Step time per pipeline stage",
            unit=p.SECONDS,
            description="Median step time of each pipeline stage: one slow stage is an imbalance of the partition, "
            "not a faulty rank (TrainvitalsStageImbalance).",
            targets=[p.prom(_m("trainvitals_run_stage_step_seconds", by="stage"), legend="stage {{stage}}")],
            min_value=0,
        )
    )
    board = board.with_panel(
        p.table(
            405,
            "Slowest ranks now",
            unit=p.COUNT,
            description="The top-k slowest ranks of the newest rank window: mean compute time in seconds (step minus "
            "collective wait), its ratio to the median of the rank's pipeline-stage cohort, and the rank's host "
            "(a click opens the node's hardware dashboard, variable node_dashboard_url).",
            targets=[
                p.prom(_m(f"trainvitals_rank_slowest_{family}", by="rank, host"), ref=ref, instant=True, table=True)
                for family, ref in (("compute_seconds", "A"), ("cohort_ratio", "B"))
            ],
            links=[p.node_dashboard_link()],
            transformations=[
                p.transformation("merge"),
                p.organize({"Value #A": "compute s", "Value #B": "x cohort median"}, exclude=("Time",)),
            ],
            sort_by=("compute s", True),
        )
    )
    board = board.with_panel(
        p.timeseries(
            406,
            "Slowest ranks over their cohort",
            unit=p.TIMES,
            description="Compute time of each top-k slowest rank over its cohort median, over time: a straggler "
            "stays above the pack (the detector flags r > 1.10 with a robust z > 4 for several windows).",
            targets=[
                p.prom(_m("trainvitals_rank_slowest_cohort_ratio", by="rank, host"), legend="rank {{rank}} ({{host}})")
            ],
            threshold=("green", 1.1, "orange"),
        )
    )
    board = board.with_panel(
        p.sql_heatmap(
            407,
            "Step time per rank (PostgreSQL)",
            unit=p.SECONDS,
            description="Every rank's step time over time, from the collector's steps table (Prometheus holds only "
            "the top-k ranks): a straggler is a hot row, a slow node a band of rows, a global slowdown a hot "
            "column. The newest incarnation wins where a relaunch repeated steps; a cell is the slowest step of "
            "the rank in the panel's interval.",
            sql=RANK_STEP_HEATMAP_SQL,
        )
    )
    return board


def _fp8(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(500, "FP8"))
    board = board.with_panel(
        p.timeseries(
            501,
            "Minimum FP8 headroom per layer and role (20 tightest)",
            unit=p.BITS,
            description="Bits between the largest scaled value and the FP8 format's maximum, minimum over each "
            "layer's tensors per role (input, weight, grad_output); the 20 tightest at each point. Below the "
            "0-bit line values clip.",
            targets=[
                p.prom(
                    f"bottomk(20, {_m('trainvitals_fp8_layer_min_headroom_log2', by='layer, role')})",
                    legend="{{layer}} {{role}}",
                )
            ],
            threshold=("red", 0, "green"),
        )
    )
    board = board.with_panel(
        p.table(
            502,
            "Worst tensors",
            unit=p.BITS,
            description="The k tensors with the least FP8 headroom at the newest step with FP8 statistics.",
            targets=[p.prom(_m("trainvitals_fp8_worst_headroom_log2", by="tensor, role"), instant=True, table=True)],
            transformations=[p.organize({"Value": "headroom"}, exclude=("Time",))],
            sort_by=("headroom", False),
        )
    )
    board = board.with_panel(
        p.timeseries(
            503,
            "Saturated tensors",
            unit=p.COUNT,
            description="Tensors whose headroom is below 0 bits: their largest values are clipped to the FP8 "
            "maximum (TrainvitalsFp8Clipping).",
            targets=[p.prom(_m("trainvitals_fp8_saturated_tensors"), legend="saturated tensors")],
            min_value=0,
            w=16,
        )
    )
    board = board.with_panel(
        p.stat(
            504,
            "Steps since the newest FP8 statistics",
            unit=p.COUNT,
            description="Latest step minus the newest step with FP8 statistics: the agent samples FP8 every few "
            "steps, so a small gap is normal; a growing one means FP8 data stopped arriving.",
            targets=[p.prom(f"{_m('trainvitals_run_latest_step')} - {_m('trainvitals_fp8_step')}", instant=True)],
            w=8,
            h=p.DEFAULT_HEIGHT,
        )
    )
    crest_limit = 12  # bits: fp8_precision_crest's default limit (Fp8Config.crest_bits; a test holds them equal)
    board = board.with_panel(
        p.timeseries(
            505,
            "FP8 crest of the widest E4M3 tensors",
            unit=p.BITS,
            description="log2 of a tensor's amax over its median |value|, the top-k E4M3 tensors by it, measured on "
            f"the agent's expensive steps (every 200th by default). Above the {crest_limit:g}-bit line, scaled so "
            "that the amax fits, most values sit near E4M3's subnormals (14.8 bits down) and keep few significant "
            "bits; held above it for 100 steps it is a ticket (fp8_precision_crest).",
            targets=[
                p.prom(_m("trainvitals_fp8_worst_crest_log2", by="tensor, role"), legend="{{tensor}} {{role}}")
            ],
            threshold=("green", crest_limit, "orange"),
        )
    )
    board = board.with_panel(
        p.table(
            506,
            "Widest crest: tensors",
            unit=p.BITS,
            description="The k E4M3 tensors with the widest crest (log2 amax / median |value|) at the newest "
            "step with a measured crest; E5M2 tensors are left out (15 bits more range below, not judged).",
            targets=[p.prom(_m("trainvitals_fp8_worst_crest_log2", by="tensor, role"), instant=True, table=True)],
            transformations=[p.organize({"Value": "crest"}, exclude=("Time",))],
            sort_by=("crest", True),
        )
    )
    return board


def _findings(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(600, "Findings"))
    board = board.with_panel(
        p.state_timeline(
            601,
            "Open findings",
            unit=p.COUNT,
            description="When each detector finding was open (one lane per finding: severity, kind and subject); "
            "the table beside gives the step its evidence starts at.",
            targets=[
                p.prom(
                    _m("trainvitals_finding_active", by="kind, severity, subject_kind, subject"),
                    legend="{{severity}} {{kind}} {{subject_kind}} {{subject}}",
                )
            ],
            mappings=p.value_text({"1": ("open", "red")}),
        )
    )
    def with_severity(family: str) -> str:
        """A per-finding family joined with the severity label of trainvitals_finding_active (x 1)."""
        return (
            f"{_m(family, by='kind, subject_kind, subject')}"
            " * on (kind, subject_kind, subject) group_left (severity) "
            f"{_m('trainvitals_finding_active', by='kind, severity, subject_kind, subject')}"
        )

    board = board.with_panel(
        p.table(
            602,
            "Open findings: onset and magnitude",
            unit=p.COUNT,
            description="Each open finding with the first step of its evidence (kept while the finding stays "
            "open), the step it was first raised at, the step it first paged at (empty: it has not paged), and "
            "its magnitude (unit per kind, docs/detectors.md).",
            targets=[
                p.prom(with_severity("trainvitals_finding_onset_step"), ref="A", instant=True, table=True),
                p.prom(with_severity("trainvitals_finding_detected_step"), ref="C", instant=True, table=True),
                p.prom(with_severity("trainvitals_finding_paged_step"), ref="D", instant=True, table=True),
                p.prom(with_severity("trainvitals_finding_magnitude"), ref="B", instant=True, table=True),
            ],
            transformations=[
                p.transformation("merge"),
                p.organize(
                    {
                        "Value #A": "onset step",
                        "Value #C": "detected at step",
                        "Value #D": "paged at step",
                        "Value #B": "magnitude",
                    },
                    exclude=("Time",),
                ),
            ],
            w=16,
            sort_by=("onset step", False),
        )
    )
    board = board.with_panel(
        p.timeseries(
            603,
            "Findings raised",
            unit=p.COUNT,
            description="New distinct findings per interval, by kind and severity.",
            targets=[
                p.prom(
                    _NEW_FINDINGS,
                    legend="{{severity}} {{kind}}",
                )
            ],
            min_value=0,
            bars=True,
            w=8,
        )
    )
    return board


def _checkpoints(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(700, "Checkpoints"))
    board = board.with_panel(
        p.timeseries(
            701,
            "Checkpoint age vs recommended interval",
            unit=p.SECONDS,
            description="Age of the newest persisted checkpoint against the interval the cadence advisor recommends "
            "from observed saves and failures (or the declared MTBF), with its flat-basin band (waste within 5% "
            "of the optimum). Age past the band's top means more work at risk than the optimum.",
            targets=[
                p.prom(_m("trainvitals_checkpoint_last_persisted_age_seconds"), legend="age", ref="A"),
                p.prom(
                    _m("trainvitals_checkpoint_recommended_interval_seconds"), legend="recommended interval", ref="B"
                ),
                p.prom(
                    _m("trainvitals_checkpoint_interval_band_seconds", by="bound"), legend="band {{bound}}", ref="C"
                ),
            ],
            min_value=0,
            w=12,
        )
    )
    board = board.with_panel(
        p.timeseries(
            702,
            "Steps since the newest persisted checkpoint",
            unit=p.COUNT,
            description="Complete step minus the step of the newest persisted checkpoint: the steps a crash now "
            "would repeat.",
            targets=[
                p.prom(
                    f"{_m('trainvitals_run_complete_step')} - {_m('trainvitals_checkpoint_last_persisted_step')}",
                    legend="steps at risk",
                )
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            703,
            "Checkpoint records by status",
            unit=p.COUNT,
            description="Checkpoint records by status (started, persisted, verified, failed, deleted): a rising "
            "failed line is failed saves (TrainvitalsCheckpointFailed).",
            targets=[p.prom(_m("trainvitals_checkpoint_records", by="status"), legend="{{status}}")],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            704,
            "Checkpoint stall and persist time",
            unit=p.SECONDS,
            description="Of the newest persisted generation, on its slowest rank: how long training was blocked by "
            "the save (stall) and how long until it was durable (persist; async saves persist after the stall). "
            "A growing stall is throughput lost at every save; the cadence advisor weighs it against the risk.",
            targets=[
                p.prom(_m("trainvitals_checkpoint_last_stall_seconds"), legend="stall", ref="A"),
                p.prom(_m("trainvitals_checkpoint_last_persist_seconds"), legend="persist", ref="B"),
            ],
            min_value=0,
        )
    )
    return board


def _collector(board: dash_b.Dashboard) -> dash_b.Dashboard:
    board = board.with_row(p.row(800, "The collector"))
    board = board.with_panel(
        p.timeseries(
            801,
            "Records ingested for this run",
            unit=p.RECORDS_PER_SECOND,
            description="Records stored per second for this run, over every collector process sharing the database.",
            targets=[
                p.prom(
                    f"max(rate(trainvitals_ingest_records_total{{{R}}}[$__rate_interval]))",
                    legend="records/s",
                )
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            802,
            "Batches by outcome (all runs)",
            unit=p.BATCHES_PER_SECOND,
            description="Batches decided per second by outcome, over all runs the scrape token sees: stored, "
            "duplicate (a retry of a stored batch) and rejected (unknown run, another project's run, or a value "
            "the database cannot store). Refusals before the database are in \"Agent requests refused\".",
            targets=[
                p.prom(
                    "max by (outcome) (rate(trainvitals_ingest_batches_total[$__rate_interval]))",
                    legend="{{outcome}}",
                )
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            803,
            "Analysis lag",
            unit=p.SECONDS,
            description="Steps delivered but not yet reduced, in seconds of training (steps x median step time): "
            "findings and alerts arrive this late. TrainvitalsAnalysisBehind fires above 600 s for 15 minutes.",
            targets=[p.prom(ANALYSIS_LAG, legend="lag")],
            min_value=0,
            threshold=("green", 600, "red"),
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            804,
            "Scrape of the collector",
            unit=p.SECONDS,
            description="How long Prometheus's scrape of /metrics takes (one snapshot of the summary tables per "
            "scrape), per collector; a gap means the scrape failed (TrainvitalsCollectorDown).",
            targets=[
                p.prom(
                    f'max by (instance) (scrape_duration_seconds{{job="{p.SCRAPE_JOB}"}})'
                    f' and on (instance) up{{job="{p.SCRAPE_JOB}"}} == 1',
                    legend="{{instance}}",
                )
            ],
            min_value=0,
            w=6,
        )
    )
    return _collector_process(board)


def _collector_process(board: dash_b.Dashboard) -> dash_b.Dashboard:
    """The collector processes themselves (per-process families summed over instances; the analysis
    counters come from the database, the same in every process: max)."""
    board = board.with_panel(
        p.timeseries(
            805,
            "Agent requests refused, by reason",
            unit=p.REQUESTS_PER_SECOND,
            description="Agent requests (batches, registrations) refused per second, nothing stored, by reason: "
            "unauthenticated, forbidden, unknown_run, conflict, too_large, invalid, unstorable, busy (write queue "
            "full: the agent retries) and storage_error (the database failed). Any but busy needs a fix on the "
            "agent's side or the collector's; the agent's log names it.",
            targets=[
                p.prom(
                    "sum by (reason) (rate(trainvitals_ingest_refused_total[$__rate_interval]))",
                    legend="{{reason}}",
                )
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            806,
            "Request latency",
            unit=p.SECONDS,
            description="Time to answer agent batches (POST /v1/batches), p50 and p99 over every collector process, "
            "from the request-duration histogram: a batch is answered after the commit that stores it, so this is "
            "ingest latency including the database; with an ingest journal, a batch acknowledged from it is "
            "answered before its commit (the panel \"Acknowledged before their commit\").",
            targets=[
                p.prom(
                    f"histogram_quantile({q}, sum by (le) (rate(trainvitals_http_request_duration_seconds_bucket"
                    '{route="/v1/batches", method="POST"}[$__rate_interval])))',
                    legend=f"p{round(q * 100)}",
                    ref=ref,
                )
                for q, ref in ((0.5, "A"), (0.99, "B"))
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            807,
            "Write queue",
            unit=p.RECORDS,
            description="Records accepted and not yet committed, per collector process, against the limit past which "
            "it answers 503 busy: a queue that stays near the limit means the database cannot keep up. With an "
            "ingest journal, batches are acknowledged from it only while this queue is under "
            "TRAINVITALS_INGEST_JOURNAL_ACK_RECORDS (65,536 by default): what a crash of the host can lose.",
            targets=[
                p.prom("max by (instance) (trainvitals_ingest_queue_records)", legend="queued {{instance}}", ref="A"),
                p.prom("max(trainvitals_ingest_queue_limit_records)", legend="limit", ref="B"),
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            808,
            "Analysis cycle time",
            unit=p.SECONDS,
            description="Mean time of an analysis cycle (reduce + detect over every live run) and of the newest one. "
            "Cycles longer than the analysis interval make the lag above grow.",
            targets=[
                p.prom(
                    "max(rate(trainvitals_analysis_cycle_seconds_total[$__rate_interval]))"
                    " / max(rate(trainvitals_analysis_cycles_total[$__rate_interval]))",
                    legend="mean cycle",
                    ref="A",
                ),
                p.prom("max(trainvitals_analysis_last_cycle_seconds)", legend="newest cycle", ref="B"),
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            809,
            "Records the agents lost, by reason",
            unit=p.RECORDS,
            description="Records this run's agents lost for good, so far, as they report them: queue_full (the job "
            "produced faster than the exporter could hand on), spool_full / spool_error (the collector was "
            "unreachable and neither the spool nor memory could hold more), quarantine_* (refused batches that "
            "could not be set aside), exit_timeout (still queued when the process ended). Flat at 0 is healthy; "
            "TrainvitalsAgentDroppingRecords tickets on any rise.",
            targets=[
                p.prom(f"max by (reason) (trainvitals_run_agent_dropped_records_total{{{R}}})", legend="{{reason}}")
            ],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            810,
            "Analysis errors",
            unit=p.ERRORS_PER_SECOND,
            description="Runs whose analysis raised, per second, over every run this collector analyses (the "
            "analysing process logs the run and the error; the run is retried next cycle). A run that fails "
            "cycle after cycle is TrainvitalsAnalysisFailing.",
            targets=[p.prom("max(rate(trainvitals_analysis_errors_total[$__rate_interval]))", legend="errors/s")],
            min_value=0,
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            811,
            "Ingest writers busy",
            unit=p.RATIO,
            description="Share of the last minute each collector process's batch-writer threads spent storing groups "
            "of batches (one transaction each). Near 100% the process stores all it can: if the agents send more, "
            "its write queue grows and batches wait (the write queue panel). Over 90% for 15 minutes is "
            "TrainvitalsIngestSaturated.",
            targets=[p.prom("max by (instance) (trainvitals_ingest_writers_busy_ratio)", legend="busy {{instance}}")],
            min_value=0,
            threshold=("green", 0.9, "orange"),
            w=6,
        )
    )
    board = board.with_panel(
        p.timeseries(
            812,
            "Acknowledged before their commit",
            unit=p.BATCHES_PER_SECOND,
            description="With an ingest journal (serve --ingest-journal): batches per second each collector process "
            "acknowledged once appended to its journal, before their commit, against all batch requests it "
            "answered. Until their commit (the write queue panel) a crash of the host loses them; a crash of the "
            "collector does not (the next start replays the journal). Journaled falling to 0 under load: the "
            "writers' backlog is over TRAINVITALS_INGEST_JOURNAL_ACK_RECORDS, the database failed, or the "
            "journal's disk refused a write (the collector logs it). No journaled line: no journal configured, "
            "every batch is answered after its commit.",
            targets=[
                p.prom(
                    "sum by (instance) (rate(trainvitals_ingest_journal_acks_total[$__rate_interval]))",
                    legend="journaled {{instance}}",
                    ref="A",
                ),
                p.prom(
                    'sum by (instance) (rate(trainvitals_http_requests_total{route="/v1/batches", method="POST"}'
                    "[$__rate_interval]))",
                    legend="answered {{instance}}",
                    ref="B",
                ),
            ],
            min_value=0,
            w=6,
        )
    )
    return board
