"""A stored run analysed on request (`GET /v1/runs/{run}/analysis`, `trainvitals query analysis`):
the detectors over the run's newest lookback as a live cycle runs them, against a baseline run named
for this request (default: the one its registration names). The findings are returned, not stored:
the stored ones stay the live collector's.

Usage::

    findings = analyse_run(session, run, baseline="previous-run")  # UnknownBaselineError: 404 / CLI error

It reads what the reduction stored (a run replayed with --no-analysis has nothing to judge yet),
and judges it as of the run's newest step, as replay does: an old run is not "stalled".
"""

from __future__ import annotations

import time

from sqlalchemy.orm import Session

from trainvitals.service.analysis import pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.detectors.run_all import DetectorConfig, detect
from trainvitals.service.detectors.suppression import SuppressionConfig
from trainvitals.service.store import detector_reads
from trainvitals.service.store.models import Run


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
    """The findings a live cycle would report now, against `baseline` (None: the registered one)."""
    config = config or pipeline.PipelineConfig()
    if baseline == run.run_id:
        raise UnknownBaselineError(
            f"baseline run {baseline!r} is the run itself: name an earlier run of the same project"
        )
    if baseline is not None and not detector_reads.run_in_project(session, run_id=baseline, project=run.project):
        raise UnknownBaselineError(
            f"no run {baseline!r} in project {run.project!r} to compare with: name a run of the same project "
            "(trainvitals query runs, GET /v1/runs)"
        )
    inputs = DetectorInputs(baseline_run=baseline)
    series = pipeline.build_series(session, run, now=time.time(), config=config, inputs=inputs)
    if len(series.steps.ts):  # as of its newest step (from the summaries: no scan of raw rows)
        series.now = float(series.steps.ts[-1])
    return detect(
        series, config=DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
    )
