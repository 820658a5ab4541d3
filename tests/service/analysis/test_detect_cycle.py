"""The live worker keeps the data detectors' answer through cycles that bring no new data
(pipeline.detect_cycle): its findings equal a fresh `detect` of a fresh read in every cycle, the
clock's findings (an overdue save) still appear as time passes, and new steps, late data, a new
event or a changed registration make the data detectors run again."""

import pytest

from trainvitals.service.analysis import pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.detectors.run_all import DetectorConfig, detect
from trainvitals.service.detectors.suppression import SuppressionConfig
from trainvitals.service.store import batches, queries
from trainvitals.wire import Batch, RunRegistration

CONFIG = pipeline.PipelineConfig(settle_seconds=5.0)
DETECTORS = DetectorConfig(suppression=SuppressionConfig(warmup_steps=CONFIG.detector_warmup_steps))
WORLD = 4


def _send(session, steps: range, seq: int, *, slow_rank: int, extra: list[dict] | None = None) -> None:
    for rank in range(WORLD):
        compute = 1.5 if rank == slow_rank else 1.0
        records = [
            {"kind": "step", "step": s, "ts": 100.0 + 2 * s, "step_seconds": 1.6, "compute_seconds": compute,
             "wait_seconds": 1.6 - compute, "loss": 2.0, "pp_stage": 0}
            for s in steps
        ]  # fmt: skip
        if rank == 0 and extra:
            records += extra
        batch = {"run": "r", "rank": rank, "incarnation": 1, "seq": seq, "records": records}
        batches.store_batch(session, Batch.model_validate(batch))


def _register(session, interval_seconds: float) -> None:
    batches.register_run(
        session,
        RunRegistration(run="r", parallelism={"world_size": WORLD}, detector_warmup_steps=20,
                        checkpoint={"interval_seconds": interval_seconds}),
    )  # fmt: skip


def test_cycles_without_new_data_keep_the_data_findings_and_still_judge_the_clock(session, monkeypatch) -> None:
    _register(session, interval_seconds=60.0)
    save = [{"kind": "checkpoint", "step": 10, "generation": 1, "status": "persisted", "ts": 120.0}]
    _send(session, range(250), 0, slow_rank=3, extra=save)
    calls = []
    real = pipeline.detect_on_data
    monkeypatch.setattr(pipeline, "detect_on_data", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = DetectorInputs()

    def cycle(now: float) -> list:
        run = queries.get_run(session, run_id="r")
        _, first = pipeline.reduce_steps(session, run, now=now, config=CONFIG)
        series = pipeline.build_series(session, run, now=now, config=CONFIG, inputs=inputs, rewritten_from=first)
        kept = pipeline.detect_cycle(series, inputs=inputs, config=DETECTORS)
        fresh = detect(pipeline.build_series(session, run, now=now, config=CONFIG), config=DETECTORS)
        assert kept == fresh
        return kept

    first = cycle(now=700.0)
    assert len(calls) == 1 and ("straggler", "3") in {(f.kind, f.subject) for f in first}
    # Time passes, nothing arrives: the data detectors' answer is kept, the clock's is new.
    later = cycle(now=5_000.0)
    assert len(calls) == 1
    clock_kinds = {f.kind for f in later} - {f.kind for f in first}
    assert clock_kinds, "an overdue save (or a stall) is judged at the new time"
    # A resume event, no new step: the suppression windows change, so the data detectors run.
    resume = [{"kind": "event", "ts": 600.0, "step": 240, "event": "resume"}]
    batches.store_batch(session, Batch.model_validate({"run": "r", "rank": 0, "incarnation": 1, "seq": 1,
                                                      "records": resume}))  # fmt: skip
    cycle(now=5_001.0)
    assert len(calls) == 2
    cycle(now=5_002.0)
    assert len(calls) == 2
    # New steps: run again.
    _send(session, range(250, 260), 2, slow_rank=3)
    cycle(now=5_003.0)
    assert len(calls) == 3
    # Late data for a reduced step (rank 2 restarted and replays step 255 as a new incarnation):
    # the reduction rewrites it, the detectors run again.
    replay = [{"kind": "step", "step": 255, "ts": 610.0, "step_seconds": 9.0, "loss": 2.0, "pp_stage": 0}]
    batches.store_batch(session, Batch.model_validate({"run": "r", "rank": 2, "incarnation": 2, "seq": 0,
                                                      "records": replay}))  # fmt: skip
    cycle(now=5_004.0)
    assert len(calls) == 4


@pytest.mark.parametrize("change", ["expected MFU", "warm-up"])
def test_a_changed_registration_runs_the_data_detectors_again(session, monkeypatch, change: str) -> None:
    _register(session, interval_seconds=60.0)
    _send(session, range(100), 0, slow_rank=3)
    calls = []
    real = pipeline.detect_on_data
    monkeypatch.setattr(pipeline, "detect_on_data", lambda *a, **k: calls.append(1) or real(*a, **k))
    inputs = DetectorInputs()
    for now in (700.0, 701.0):
        run = queries.get_run(session, run_id="r")
        series = pipeline.build_series(session, run, now=now, config=CONFIG, inputs=inputs, rewritten_from=None)
        pipeline.detect_cycle(series, inputs=inputs, config=DETECTORS)
    assert len(calls) == 1
    registration = dict(run.registration or {})
    if change == "expected MFU":
        registration["tags"] = {"expected_mfu": "0.4"}
    else:
        registration["detector_warmup_steps"] = 50
    run.registration = registration
    series = pipeline.build_series(session, run, now=702.0, config=CONFIG, inputs=inputs, rewritten_from=None)
    pipeline.detect_cycle(series, inputs=inputs, config=DETECTORS)
    assert len(calls) == 2
