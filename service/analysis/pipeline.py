"""The collector's analysis loop for one run: reduce new raw rows into summaries, build the
detector inputs from the summaries, run the detectors, store their findings.

Live, a background worker calls `process_run` every few seconds for every live run; offline,
`trainvitals replay` calls it once at the end: the same code, so results are identical. This
module only orders the steps: the reads and writes are service/store/ (summaries.py,
detector_reads.py, findings.py), the arithmetic reduction.py and the detectors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sqlalchemy.orm import Session

from trainvitals.service.analysis import reduction
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.detectors.series import RunSeries
from trainvitals.service.store import findings, summaries
from trainvitals.service.store.models import Run
from trainvitals.wire.conventions import GLOBAL_GROUP


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineConfig:
    settle_seconds: float = 30.0
    """A step is reduced once every rank sent it, or once it is this old (a rank may be dead)."""
    rank_window_steps: int = 50
    """Steps per rank window (the straggler view)."""
    detector_lookback_steps: int = 20_000
    """Detectors see at most this many recent steps (bounded work per cycle)."""
    straggler_lookback_steps: int = 600
    """Per-rank per-step timing the straggler detectors see (12 windows of 50 steps)."""
    detector_warmup_steps: int = 300
    """Steps from the run's start during which detectors stay quiet (LR warm-up, early loss drop)."""


def reduce_run(session: Session, run: Run, *, now: float, config: PipelineConfig = PipelineConfig()) -> int:
    """Reduce not-yet-reduced (or re-dirtied) steps; returns how many steps were (re)written."""
    return reduce_steps(session, run, now=now, config=config)[0]


def reduce_steps(session: Session, run: Run, *, now: float, config: PipelineConfig) -> tuple[int, int | None]:
    """(steps (re)written, the first step whose stored rows changed since the last cycle or None).

    Late rows for reduced steps that cannot be reduced again yet (the watermark has not reached
    them) still count as changed: the detectors' per-rank timing reads raw rows."""
    rid = run.run_id
    state = summaries.reduction_state(session, run_id=rid)
    start = state.reduced_upto + 1
    if state.dirty_from is not None:
        start = min(start, state.dirty_from)
    upto = summaries.reducible_upto(session, run=run, start=start, now=now, settle_seconds=config.settle_seconds)
    if upto < start:
        session.commit()
        return 0, state.dirty_from
    # Whole rank windows are recomputed, so read from the start of the first touched window.
    w = config.rank_window_steps
    read_from = min(start, start // w * w)
    rows = [
        reduction.StepIn(*r)
        for r in summaries.step_rows(session, run_id=rid, first=read_from, last=upto, columns=reduction.STEP_IN_COLUMNS)
    ]
    grads = reduction.summarize_grads(summaries.grad_rows(session, run_id=rid, first=start, last=upto))
    global_norms = {g["step"]: (g["norm"], g["nonfinite"]) for g in grads if g["group_name"] == GLOBAL_GROUP}
    steps = reduction.summarize_steps(
        [r for r in rows if r.step >= start],
        peak_flops_total=reduction.peak_flops_total(run.registration),
        agent_grad_norms=global_norms,
    )
    summaries.replace_summaries(
        session,
        state=state,
        first=start,
        windows_from=read_from,
        last=upto,
        steps=steps,
        grads=grads,
        tensors=summaries.tensor_summaries(session, run_id=rid, first=start, last=upto),
        windows=reduction.summarize_rank_windows(rows, window=w),
    )
    return len(steps), start


def build_series(
    session: Session,
    run: Run,
    *,
    now: float,
    config: PipelineConfig = PipelineConfig(),
    inputs: DetectorInputs | None = None,
    rewritten_from: int | None = None,
) -> RunSeries:
    """RunSeries (the detectors' input) from the summary tables, over the recent lookback.

    inputs: what an earlier cycle read for this run (the worker keeps one per run); None reads
    the whole lookback. rewritten_from: the first step this cycle's reduction (re)wrote.
    """
    inputs = DetectorInputs() if inputs is None else inputs
    return inputs.build(
        session,
        run,
        rewritten_from=rewritten_from,
        now=now,
        lookback_steps=config.detector_lookback_steps,
        rank_lookback_steps=config.straggler_lookback_steps,
    )


def process_run(
    session: Session,
    run: Run,
    *,
    now: float | None = None,
    config: PipelineConfig = PipelineConfig(),
    inputs: DetectorInputs | None = None,
) -> int:
    """Reduce, detect, store findings. Returns the number of steps reduced.

    inputs: the run's detector inputs kept from the previous cycle (live worker); None: read them whole.
    """
    now = time.time() if now is None else now
    reduced, first = reduce_steps(session, run, now=now, config=config)
    from trainvitals.service.detectors.run_all import DetectorConfig, detect
    from trainvitals.service.detectors.suppression import SuppressionConfig

    series = build_series(session, run, now=now, config=config, inputs=inputs, rewritten_from=first)
    detector_config = DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
    findings.store_findings(session, run_id=run.run_id, findings=detect(series, config=detector_config), now=now)
    return reduced
