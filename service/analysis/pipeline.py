"""The collector's analysis loop for one run: reduce new raw rows into summaries, build the
detector inputs from the summaries, run the detectors, store their findings.

Live, a background worker calls `process_run` every few seconds for every live run; offline,
`trainvitals replay` calls it once at the end. A call with more new steps than a live cycle brings
(a recording, a worker catching up after downtime) walks them in cycles of `catch_up_steps`, each
judged as of its own last step, so the detectors see the sequence of windows a live collector would
have seen and find the same faults with the same onsets, early ones included, not only those in
the last lookback. This module only orders the steps: the reads and writes are service/store/
(summaries.py, detector_reads.py, findings.py), the arithmetic reduction.py and the detectors.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from dataclasses import dataclass

from sqlalchemy.orm import Session

from trainvitals.service.analysis import reduction
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.detectors.run_all import DetectorConfig, detect, detect_on_data, detect_on_data_reads
from trainvitals.service.detectors.series import RunSeries
from trainvitals.service.detectors.stragglers import StragglerConfig
from trainvitals.service.store import detector_blocks, findings, summaries
from trainvitals.service.store.incarnations import replayed_steps
from trainvitals.service.store.models import Run
from trainvitals.wire.conventions import DEFAULT_DETECTOR_WARMUP_STEPS, GLOBAL_GROUP, auto_send_interval_s


@dataclass(kw_only=True, slots=True, frozen=True)
class PipelineConfig:
    settle_seconds: float = 30.0
    """A step is reduced once every rank sent it, or once it is this old (a rank may be dead); at
    least the agent's automatic send interval plus SETTLE_MARGIN_S for the run's size
    (`settle_seconds_for`): 32 s at 16,384 ranks, when a rank's step may still be on its way."""
    rank_window_steps: int = 50
    """Steps per rank window (the straggler view)."""
    detector_lookback_steps: int = 20_000
    """Detectors see at most this many recent steps (bounded work per cycle)."""
    straggler_lookback_steps: int = 600
    """Per-rank per-step timing the straggler detectors see (12 windows of 50 steps)."""
    detector_warmup_steps: int = DEFAULT_DETECTOR_WARMUP_STEPS
    """Steps from the run's start during which detectors stay quiet (LR warm-up, early loss drop)."""
    catch_up_steps: int | None = None
    """Steps per cycle when a backlog longer than the shorter lookback (replay of a recording, a
    worker catching up after downtime) is walked as live cycles would have taken it. None: the
    straggler detectors' window (50 steps; less if a lookback is under 100). A finding can exist
    in only a few consecutive views (an intermittent-straggler ticket that becomes a page, then a
    straggler page, within 50 steps), and a live collector, cycling every few seconds, stores it;
    short cycles keep it too. Coarser is cheaper (docs/performance.md) and still finds every
    episode shorter than about half the lookback, but can miss such short-lived findings."""

    def __post_init__(self) -> None:
        if self.catch_up_steps is not None and self.catch_up_steps < 1:
            raise ValueError("catch_up_steps must be >= 1")

    @property
    def cycle_steps(self) -> int:
        """catch_up_steps, resolved."""
        if self.catch_up_steps is not None:
            return self.catch_up_steps
        half = min(self.straggler_lookback_steps, self.detector_lookback_steps) // 2
        return max(min(StragglerConfig().window_steps, half), 1)


def reduce_run(session: Session, run: Run, *, now: float, config: PipelineConfig = PipelineConfig()) -> int:
    """Reduce not-yet-reduced (or re-dirtied) steps; returns how many steps were (re)written."""
    return reduce_steps(session, run, now=now, config=config)[0]


SETTLE_MARGIN_S = 15.0
"""Beyond a rank's send interval: its pass's own time, a retry, the request's way to the database."""


def settle_seconds_for(run: Run, config: PipelineConfig) -> float:
    """How long a step waits for its missing ranks: the configured settle time, but never less than
    one automatic send interval of the run's size plus SETTLE_MARGIN_S (wire/conventions.py
    auto_send_interval_s): a larger job's ranks send less often, and reducing a step before its
    last ranks' rows arrive would reduce it again when they do. An agent with a longer explicit
    interval than that needs the settle time raised (TRAINVITALS_SETTLE_SECONDS)."""
    return max(config.settle_seconds, auto_send_interval_s(run.world_size) + SETTLE_MARGIN_S)


def reduce_steps(
    session: Session, run: Run, *, now: float, config: PipelineConfig, upto: int | None = None
) -> tuple[int, int | None]:
    """(steps (re)written, the first step whose stored rows changed since the last cycle or None).

    Late rows for reduced steps that cannot be reduced again yet (the watermark has not reached
    them) still count as changed: the detectors' per-rank timing reads raw rows.
    upto: reduce no further than this step, which the caller knows to be reducible (a catch-up
    cycle); None: as far as every rank has sent or the settle time allows. The steps are claimed
    before any row is read (summaries.claim_steps), so rows that arrive meanwhile are not missed."""
    rid = run.run_id
    state = summaries.progress(session, run_id=rid)
    if upto is None:
        upto = summaries.reducible_upto(
            session, run=run, start=state.start, now=now, settle_seconds=settle_seconds_for(run, config)
        )
    if upto < state.start:
        if state.dirty_from is not None:  # late raw timing rows: the detectors' stored blocks of them go
            detector_blocks.forget_from(session, run_id=rid, step=state.dirty_from)
        session.commit()
        return 0, state.dirty_from
    claimed = summaries.claim_steps(session, run_id=rid, upto=upto)
    start = claimed.start  # ingest may have re-dirtied earlier steps since the first read
    # Whole rank windows are recomputed, so read from the start of the first touched window.
    w = config.rank_window_steps
    read_from = min(start, start // w * w)
    rows = [
        reduction.StepIn(*r)
        for r in summaries.step_rows(session, run_id=rid, first=read_from, last=upto, columns=reduction.STEP_IN_COLUMNS)
    ]
    grads = summaries.grad_summaries(session, run_id=rid, first=start, last=upto)
    global_norms = {g["step"]: (g["norm"], g["nonfinite"]) for g in grads if g["group_name"] == GLOBAL_GROUP}
    steps = reduction.summarize_steps(
        [r for r in rows if r.step >= start],
        peak_flops_total=reduction.peak_flops_total(run.registration),
        agent_grad_norms=global_norms,
        batch_copies=reduction.batch_copies(run.registration),
    )
    tensors = summaries.tensor_summaries(session, run_id=rid, first=start, last=upto)
    windows = reduction.summarize_rank_windows(rows, window=w)
    # The first write of the rewrite, after every read: on SQLite a write takes the one write lock
    # until the commit, and ingest's writer waits for it (late data, which leaves blocks to
    # delete, would otherwise hold it through the tensor aggregation's seconds).
    detector_blocks.forget_from(session, run_id=rid, step=start)  # committed with the rewrite
    summaries.replace_summaries(
        session,
        run_id=rid,
        claimed=claimed,
        first=start,
        windows_from=read_from,
        last=upto,
        steps=steps,
        grads=grads,
        tensors=tensors,
        windows=windows,
        replayed={s for s in replayed_steps(rows) if s >= start},
    )
    return len(steps), start


def cycle_ends(
    *, start: int, reduced_upto: int, reducible: int, steps: int, present: Iterable[int] | None = None
) -> list[int]:
    """The last step of each cycle reducing start..reducible: multiples of `steps` (minus one), so
    cycles end where rank windows do when `steps` is a multiple of the window. The first cycle
    reaches at least reduced_upto: the reduction state records one reduced range, so re-dirtied
    steps below it are rewritten in one go.

    present: the cycles (step // steps) that hold steps (summaries.step_buckets); the others are
    skipped, so a gap in the steps costs nothing (one record at step 2**53 once asked for 2**47 cycles).
    None: every cycle of the range."""

    def end_from(step: int) -> int:  # the first cycle end at or after step
        return (step // steps + 1) * steps - 1

    first = max(end_from(start), reduced_upto)
    if first >= reducible:
        return [reducible]
    if present is None:
        return [first, *range(end_from(first + 1), reducible, steps), reducible]
    later = sorted({end_from(b * steps) for b in present} - {first, reducible})
    return [first, *(e for e in later if first < e < reducible), reducible]


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

    A live run's few new steps are one cycle. A backlog longer than the shorter lookback (replay, a
    stored run, a worker catching up after downtime) is walked in cycles of `config.cycle_steps`:
    every cycle but the last is judged as of its own newest step (its `now` is that step's time and
    it sees only the checkpoints and events recorded by then), the last at `now`.
    inputs: the run's detector inputs kept from the previous call (live worker); None: read them
    whole, then keep them across this call's cycles.
    """
    from trainvitals.service.detectors.suppression import SuppressionConfig

    now = time.time() if now is None else now
    inputs = DetectorInputs() if inputs is None else inputs
    detector_config = DetectorConfig(suppression=SuppressionConfig(warmup_steps=config.detector_warmup_steps))
    state = summaries.progress(session, run_id=run.run_id)
    start = state.start
    reducible = summaries.reducible_upto(
        session, run=run, start=start, now=now, settle_seconds=settle_seconds_for(run, config)
    )
    # New steps that the shorter lookback still holds whole are one cycle, as live cycles always
    # were (splitting them would multiply a fast run's detector work every few seconds); a longer
    # backlog is walked, or its early steps would leave the detectors' view unseen.
    if reducible - start < min(config.straggler_lookback_steps, config.detector_lookback_steps):
        ends = [reducible]
    else:
        n = config.cycle_steps
        present = summaries.step_buckets(session, run_id=run.run_id, first=start, last=reducible, steps=n)
        ends = cycle_ends(start=start, reduced_upto=state.reduced_upto, reducible=reducible, steps=n, present=present)
    total = 0
    for i, upto in enumerate(ends):
        reduced, first = reduce_steps(session, run, now=now, config=config, upto=upto)
        total += reduced
        series = build_series(session, run, now=now, config=config, inputs=inputs, rewritten_from=first)
        at = now
        if i < len(ends) - 1 and len(series.steps.ts):  # a catch-up cycle: as of its newest step
            at = float(series.steps.ts[-1])
            series = as_of(series, at)
        found = detect_cycle(series, inputs=inputs, config=detector_config)
        findings.store_findings(session, run_id=run.run_id, findings=found, now=at)
    return total


def detect_cycle(series: RunSeries, *, inputs: DetectorInputs, config: DetectorConfig) -> list[Finding]:
    """detect(series), keeping the data detectors' answer of the last cycle when `inputs` built
    the same data (no new or rewritten step) under the same events and registration: a run whose
    steps take longer than a cycle (2 s apart) has cycles that find no new step, and at 16,384
    ranks each found the same findings again for 1.5-1.8 s. The checkpoint detectors, which judge
    the clock, always run."""
    key = detect_on_data_reads(series, config)  # the arrays themselves: `same_data`
    kept = inputs.kept_findings
    if inputs.same_data and kept is not None and kept[0] == key:
        data_found = kept[1]
    else:
        data_found = detect_on_data(series, config=config)
        inputs.kept_findings = (key, data_found)
    return detect(series, config=config, data_findings=data_found)


def as_of(series: RunSeries, now: float) -> RunSeries:
    """The series as a live collector had it at `now` (a catch-up cycle's newest step): checkpoint
    and event records stamped later are not in yet, so a save is not judged overdue, nor a run
    stopped, because of records that arrived after this cycle."""
    return dataclasses.replace(
        series,
        now=now,
        checkpoints=[c for c in series.checkpoints if c.ts <= now],
        events=[e for e in series.events if e.ts <= now],
    )
