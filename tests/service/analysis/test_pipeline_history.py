"""A stored run longer than the detectors' lookback is analysed over its whole history, as a live
collector would have analysed it: replay finds early faults with their own onsets (not only what
is in the last lookback), and its findings equal those of the same recording fed live, batch by
batch, through the analysis worker's incremental path.

Live and replay are compared at the same cycle ends (every 50 steps). Stored findings depend on
where cycles end, live too: one that exists only between two cycles (an intermittent-straggler
ticket that becomes a page 25 steps later, then a straggler page) is stored by a collector that
happened to cycle then. Replay stores what a collector cycling once per straggler window stores.

On PostgreSQL only: the walk is the same code on both backends (the store's statements are tested
on both elsewhere), and feeding the run live is most of this test's time."""

import dataclasses
import json
import math
import random
from pathlib import Path

import numpy as np
import pytest

from trainvitals.service.analysis import on_request, pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.ingest.replay import replay_files
from trainvitals.service.store import batches, queries
from trainvitals.testing.scenarios import Layout, Scenario, make_scenario, prefix, scenario_key, to_wire_lines
from trainvitals.wire import Batch, RunRegistration

# Lookback 800 steps over a 2,400-step run: three lookbacks; cycles of 50 steps (the default).
CONFIG = pipeline.PipelineConfig(detector_lookback_steps=800)
STEPS = 2400
NAN_LOSS_STEP = 500
SPIKE_STEPS = (600, 680, 760, 840, 920, 1000)
NAN_GRAD_STEP = 2300


def _recording() -> Scenario:
    """A straggler from step ~1,600 (the family's own fault) on 3 ranks of one stage, plus a NaN
    loss and recurring gradient spikes early and a non-finite gradient late."""
    sc = make_scenario("straggler", 101, layout=Layout(pp=1, dp=3, ranks_per_node=3, layers=1, groups=2))
    sc = dataclasses.replace(sc, series=prefix(sc.series, STEPS - 1))
    s, g = sc.series.steps, sc.series.groups
    assert g is not None and len(s.steps) == STEPS
    s.loss[NAN_LOSS_STEP] = math.nan
    s.loss_nonfinite[NAN_LOSS_STEP] = sc.layout.dp
    g.norms[list(SPIKE_STEPS), 0] *= 5.0
    g.norms[NAN_GRAD_STEP, 1] = math.nan
    s.grad_norm[:] = np.sqrt(np.sum(g.norms**2, axis=1))
    return sc


def _renamed(sc: Scenario, run: str) -> Scenario:
    return dataclasses.replace(sc, series=dataclasses.replace(sc.series, run=run))


def _findings(session, run: str) -> set[tuple[str, str, int, str]]:
    stored = queries.findings(session, run_id=scenario_key(run))
    return {(f["kind"], f["subject"], f["onset_step"], f["severity"]) for f in stored}


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)
def test_replay_walks_the_whole_run_and_equals_live(session, tmp_path: Path) -> None:
    sc = _recording()
    path = tmp_path / "run.jsonl"
    path.write_text("".join(line + "\n" for line in to_wire_lines(_renamed(sc, "replayed"))))
    report = replay_files(session, [str(path)], config=CONFIG)
    assert report.rejected_lines == 0 and report.steps_reduced == STEPS
    replayed = _findings(session, "replayed")

    # Every fault, early and late, with the step it started at; the last lookback alone holds
    # only the straggler (from ~1,500-2,500 on) and the late NaN gradient.
    by_kind = {(kind, subject): (onset, sev) for kind, subject, onset, sev in replayed}
    assert by_kind[("loss_nonfinite", "")] == (NAN_LOSS_STEP, "page")
    assert by_kind[("grad_spikes_recurring", "")] == (SPIKE_STEPS[0], "page")
    assert by_kind[("grad_nonfinite", "layers.1")] == (NAN_GRAD_STEP, "page")
    onset, severity = by_kind[("straggler", sc.expect_subject)]
    assert sc.injected_step is not None and abs(onset - sc.injected_step) <= 25 and severity == "page"

    # On request, over the stored summaries: the same findings, the early ones with their onsets.
    run = queries.get_run(session, run_id=scenario_key("replayed"))
    asked = on_request.analyse_run(session, run, config=CONFIG)
    assert {(f.kind, f.subject, f.onset_step, f.severity) for f in asked} == replayed
    early = {
        (f.kind, f.subject): (f.onset_step, f.severity)
        for f in asked
        if f.onset_step < STEPS - CONFIG.detector_lookback_steps
    }
    assert early[("loss_nonfinite", "")] == (NAN_LOSS_STEP, "page")  # both left the last lookback
    assert early[("grad_spikes_recurring", "")] == (SPIKE_STEPS[0], "page")
    stored = {
        (f["kind"], f["subject"]): (f["detected_step"], f["active"])
        for f in queries.findings(session, run_id=scenario_key("replayed"))
    }
    assert {(f.kind, f.subject): (f.detected_step, f.active) for f in asked} == stored

    # The same recording fed live: batches of 25 steps, each rank's arriving in its own order
    # within 50 steps (the watermark waits for the last), a worker cycle after every 50 steps.
    rng = random.Random(0)
    lines = [json.loads(line) for line in to_wire_lines(_renamed(sc, "live"), steps_per_batch=25)]
    batches.register_run(session, RunRegistration.model_validate(lines[0]))
    inputs = DetectorInputs()
    per_cycle = 2 * sc.layout.world
    for k in range(1, len(lines), per_cycle):
        arriving = lines[k : k + per_cycle]
        rng.shuffle(arriving)
        for body in arriving:
            batches.store_batch(session, Batch.model_validate(body))
        run = queries.get_run(session, run_id=scenario_key("live"))
        now = max(b["sent_at"] for b in arriving)
        pipeline.process_run(session, run, now=now, config=CONFIG, inputs=inputs)
    assert _findings(session, "live") == replayed


@pytest.mark.parametrize(
    ("start", "reduced_upto", "reducible", "ends"),
    [
        (0, -1, 160, [49, 99, 149, 160]),  # cycles end where 50-step windows do
        (0, -1, 149, [49, 99, 149]),
        (120, 119, 260, [149, 199, 249, 260]),  # a catch-up from mid-window
        (20, 130, 260, [130, 149, 199, 249, 260]),  # re-dirtied steps below 130: rewritten in one cycle
        (50, 49, 30, [30]),  # nothing reducible: one cycle that reduces nothing
    ],
)
def test_cycle_ends(start: int, reduced_upto: int, reducible: int, ends: list[int]) -> None:
    assert pipeline.cycle_ends(start=start, reduced_upto=reduced_upto, reducible=reducible, steps=50) == ends


def test_cycle_steps_default() -> None:
    assert pipeline.PipelineConfig().cycle_steps == 50  # the straggler window
    assert pipeline.PipelineConfig(detector_lookback_steps=15, straggler_lookback_steps=7).cycle_steps == 3
    assert pipeline.PipelineConfig(catch_up_steps=300).cycle_steps == 300
