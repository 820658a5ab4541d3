"""A stored run analysed on request (`GET /v1/runs/{run}/analysis`, `trainvitals query analysis`):
the detectors over the run's whole history in the cycles a live collector (and replay) runs them,
against a baseline run named for this request (default: the one its registration names). The
findings are returned, not stored: the stored ones stay the live collector's.

Usage::

    findings = analyse_run(session, run, baseline="previous-run")  # UnknownBaselineError: 404 / CLI error

It reads what the reduction stored (a run replayed with --no-analysis has nothing to judge yet).
The view is stepped from the first reduced step to the newest in `PipelineConfig.cycle_steps`
cycles (pipeline.py, the cycle ends replay uses), each judged as of its newest step with only the
checkpoints and events recorded by then, and each cycle's findings are folded with the stored-
findings rules (service/store/findings.py `fold_findings`: stable onsets, a reopened finding a new
episode). So a NaN early in a long run is reported with its own step, not missed because it left
the last lookback, and the result equals what replay stores. The last cycle is judged as of the
run's newest step, as replay does: an old run is not "stalled".
"""

from __future__ import annotations

import time
from typing import cast

from sqlalchemy.orm import Session

from trainvitals.service.analysis import pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.detectors.findings import Finding, Severity, SubjectKind
from trainvitals.service.detectors.run_all import DetectorConfig, detect
from trainvitals.service.detectors.suppression import SuppressionConfig
from trainvitals.service.store import detector_reads, queries, run_keys, summaries
from trainvitals.service.store.findings import HeldFinding, Key, fold_findings
from trainvitals.service.store.models import Run

_SEVERITY_ORDER = {"page": 0, "ticket": 1}  # as the stored findings are listed; info last


class UnknownBaselineError(LookupError):
    """The named baseline is not another run of the analysed run's project (the message says so and
    what to name instead). A run of another project is reported exactly like a missing one."""


def analyse_run(
    session: Session,
    run: Run,
    *,
    baseline: str | None = None,
    config: pipeline.PipelineConfig | None = None,
) -> list[Finding]:
    """The findings a live collector would hold for the run now, over its whole history, against
    `baseline` (None: the registered one); open and resolved, pages first, then by onset."""
    config = config or pipeline.PipelineConfig()
    if baseline is not None and run_keys.run_key(run.project, baseline) == run.run_id:
        raise UnknownBaselineError(
            f"baseline run {baseline!r} is the run itself: name an earlier run of the same project"
        )
    if baseline is not None and not detector_reads.run_in_project(
        session, run_id=run_keys.run_key(run.project, baseline), project=run.project
    ):
        raise UnknownBaselineError(
            f"no run {baseline!r} in project {run.project!r} to compare with: name a run of the same project "
            "(trainvitals query runs, GET /v1/runs)"
        )
    detector_config = DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
    inputs = DetectorInputs(baseline_run=baseline)
    held: dict[Key, HeldFinding] = {}
    ends = _cycle_ends(session, run, config)
    for i, upto in enumerate(ends):
        series = inputs.build(
            session,
            run,
            rewritten_from=None,
            now=time.time(),
            lookback_steps=config.detector_lookback_steps,
            rank_lookback_steps=config.straggler_lookback_steps,
            upto=upto,
        )
        if len(series.steps.ts):  # as of its newest step (from the summaries: no scan of raw rows)
            at = float(series.steps.ts[-1])
            # Every cycle but the last sees only the records a live collector had by then, as in replay.
            series = pipeline.as_of(series, at) if i < len(ends) - 1 else series
            series.now = at
        held = fold_findings(held, detect(series, config=detector_config))
    return [_finding(run.run_id, h) for h in sorted(held.values(), key=_listed)]


def _cycle_ends(session: Session, run: Run, config: pipeline.PipelineConfig) -> list[int | None]:
    """The newest step of each cycle's view: the steps replay would walk the run in, one cycle when
    the shorter lookback holds the whole run (None: the newest reduced step, as for a run with none)."""
    reduced = queries.reduced_step_range(session, run_id=run.run_id)
    if reduced is None:
        return [None]
    first, newest = reduced
    if newest - first < min(config.straggler_lookback_steps, config.detector_lookback_steps):
        return [newest]
    n = config.cycle_steps
    present = summaries.step_buckets(session, run_id=run.run_id, first=first, last=newest, steps=n, reduced=True)
    return list(pipeline.cycle_ends(start=first, reduced_upto=-1, reducible=newest, steps=n, present=present))


def _listed(h: HeldFinding) -> tuple[int, int, str, str]:
    return (_SEVERITY_ORDER.get(h.severity, 2), h.onset_step, h.kind, h.subject)


def _finding(run_id: str, h: HeldFinding) -> Finding:
    return Finding(
        kind=h.kind,
        severity=cast(Severity, h.severity),
        run=run_id,
        subject_kind=cast(SubjectKind, h.subject_kind),
        subject=h.subject,
        onset_step=h.onset_step,
        last_step=h.last_step,
        magnitude=h.magnitude,
        summary=h.summary,
        active=h.active,
        detected_step=h.detected_step,
        paged_step=h.paged_step,
    )
