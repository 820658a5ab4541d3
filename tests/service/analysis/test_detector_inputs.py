"""Detector inputs kept between analysis cycles equal a fresh read of the whole lookback, cycle
after cycle: through late data, a restart that replays steps, a rank that appears late, tensors
and groups that come and go, and lookbacks short enough that rows leave the window."""

import dataclasses
import random

import numpy as np
import pytest

from trainvitals.service.analysis import detector_inputs, pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.store import batches, detector_reads, queries
from trainvitals.wire import Batch, RunRegistration

WORLD = 4
CONFIG = pipeline.PipelineConfig(settle_seconds=5.0, detector_lookback_steps=15, straggler_lookback_steps=7)


def _records(rank: int, step: int, inc: int, rng: random.Random) -> list[dict]:
    recs: list[dict] = [
        {"kind": "step", "step": step, "ts": 100.0 + step, "step_seconds": 1.0 + rng.random(),
         "compute_seconds": rng.choice([None, 0.8]), "wait_seconds": 0.1, "loss": rng.choice([2.0, 2.5, "nan"]),
         "tokens": 10, "flops": 1e9, "pp_stage": rank % 2},
        {"kind": "grad", "step": step, "group": "__global__", "owned_sq": 1.0, "local_sq": 1.0},
        {"kind": "grad", "step": step, "group": f"layers.{rank % 2}", "owned_sq": rng.random(), "local_sq": 1.0},
    ]  # fmt: skip
    if step % 3 == 0 or step > 30:  # a tensor sampled on some steps, another appearing late
        recs.append({"kind": "tensor", "step": step, "tensor": "layers.0.fc", "role": "input", "format": "e4m3",
                     "amax": rng.random() * inc, "headroom_bits": rng.random() * 4})  # fmt: skip
        if step % 6 == 0:  # crest on the expensive steps only, NaN between
            recs[-1]["crest_bits"] = rng.random() * 16
    if step > 20:
        recs.append({"kind": "tensor", "step": step, "tensor": f"layers.{rank % 2}.proj", "role": "grad_output",
                     "format": "e5m2", "amax": rng.random(), "headroom_bits": 1.0,
                     "sat_frac": rng.random()})  # fmt: skip
    return recs


def _assert_same(cached: object, fresh: object, path: str = "series") -> None:
    if isinstance(fresh, np.ndarray):
        assert isinstance(cached, np.ndarray), path
        assert cached.dtype == fresh.dtype and cached.shape == fresh.shape, path
        assert np.array_equal(cached, fresh, equal_nan=fresh.dtype.kind == "f"), path
    elif dataclasses.is_dataclass(fresh):
        assert type(cached) is type(fresh), path
        for f in dataclasses.fields(fresh):
            _assert_same(getattr(cached, f.name), getattr(fresh, f.name), f"{path}.{f.name}")
    elif isinstance(fresh, list):
        assert isinstance(cached, list) and len(cached) == len(fresh), path
        for i, (c, f) in enumerate(zip(cached, fresh, strict=True)):
            _assert_same(c, f, f"{path}[{i}]")
    else:
        assert cached == fresh, path


@pytest.mark.parametrize(("seed", "streamed", "spare_rows"), [(1, False, None), (2, True, None), (3, False, 2)])
def test_kept_inputs_equal_a_fresh_read_every_cycle(
    session, seed: int, streamed: bool, spare_rows: int | None, monkeypatch
) -> None:
    if spare_rows is not None:  # the timing matrices' room runs out every few cycles
        monkeypatch.setattr(detector_inputs, "_SPARE_ROWS", spare_rows)
    if streamed:  # every read streams, in chunks small enough that tensors and steps span several
        monkeypatch.setattr(detector_reads, "_STREAM_STEPS", 0)
        monkeypatch.setattr(detector_reads, "_CHUNK_ROWS", 7)
    rng = random.Random(seed)
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": WORLD},
                                                 hardware={"gpu_count": WORLD, "peak_flops": 1e10}))  # fmt: skip
    incarnation = dict.fromkeys(range(WORLD), 1)
    sent = dict.fromkeys(range(WORLD), 0)  # next step each rank sends
    seq = dict.fromkeys(range(WORLD), 0)
    inputs = DetectorInputs()
    handed_out = []  # each cycle's timing matrices, with a copy of what they held then
    for cycle in range(14):
        n = rng.randint(2, 5)  # steps per batch this cycle, the same for every rank (they run in lockstep)
        for rank in range(WORLD):
            if rank == 3 and cycle < 3:
                continue  # joins late (elastic): the timing matrix gains a column
            if rank == 3 and cycle == 3:
                sent[3] = sent[0] - n  # where rank 0 was before this cycle's batch
            k = n
            if rank == 2 and cycle in (5, 6):
                continue  # an outage: its steps arrive late and re-dirty reduced ones
            if rank == 2 and cycle == 7:
                k += sent[0] - n - sent[2]  # the spool replays what the outage held back
            if rank == 1 and cycle == 9:
                incarnation[1] += 1  # restart from an earlier checkpoint: steps replayed, newest wins
                sent[1] -= 6
                k += 6  # and it catches up within the cycle
            steps = range(sent[rank], sent[rank] + k)
            recs = [r for s in steps for r in _records(rank, s, incarnation[rank], rng)]
            batch = Batch.model_validate(
                {"run": "r", "rank": rank, "incarnation": incarnation[rank], "seq": seq[rank], "records": recs}
            )
            batches.store_batch(session, batch)
            sent[rank] += k
            seq[rank] += 1
        now = 100.0 + max(sent.values()) + rng.choice([0.0, 10.0])  # sometimes the laggards settle
        run = queries.get_run(session, run_id="r")
        _, first = pipeline.reduce_steps(session, run, now=now, config=CONFIG)
        cached = pipeline.build_series(session, run, now=now, config=CONFIG, inputs=inputs, rewritten_from=first)
        fresh = pipeline.build_series(session, run, now=now, config=CONFIG)
        _assert_same(cached, fresh)
        if cached.ranks is not None:
            handed_out.append((cached.ranks.step_seconds, cached.ranks.step_seconds.copy()))
    # The kept matrices grow in place; what an earlier cycle's detectors got never changed after.
    for then, copy in handed_out:
        assert np.array_equal(then, copy, equal_nan=True)
    if streamed:  # and chunked reads equal whole ones
        monkeypatch.setattr(detector_reads, "_STREAM_STEPS", 10**9)
        _assert_same(fresh, pipeline.build_series(session, run, now=now, config=CONFIG))
    # The scenario reached what it is about: trimmed windows, a full timing matrix, both tensors.
    assert fresh.ranks is not None and list(fresh.ranks.ranks) == [0, 1, 2, 3]
    assert len(fresh.ranks.steps) == CONFIG.straggler_lookback_steps
    assert len(fresh.steps.steps) == CONFIG.detector_lookback_steps
    assert {t.tensor for t in fresh.tensors} >= {"layers.0.fc", "layers.0.proj", "layers.1.proj"}
    assert fresh.steps.loss_nonfinite is not None and fresh.steps.loss_nonfinite.sum() > 0  # NaN losses kept


def test_kept_arrays_are_read_only(session) -> None:
    """Detectors get the kept arrays themselves: one writing into them must fail, not corrupt the
    next cycle."""
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 1}))
    rng = random.Random(0)
    recs = [r for s in range(5) for r in _records(0, s, 1, rng)]
    batches.store_batch(session, Batch.model_validate({"run": "r", "rank": 0, "incarnation": 1, "seq": 0,
                                                      "records": recs}))  # fmt: skip
    run = queries.get_run(session, run_id="r")
    pipeline.reduce_steps(session, run, now=1e9, config=CONFIG)
    series = pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=DetectorInputs())
    with pytest.raises(ValueError, match="read-only"):
        series.steps.loss[0] = 0.0
    with pytest.raises(ValueError, match="read-only"):
        series.ranks.step_seconds[0, 0] = 0.0


@pytest.mark.parametrize(
    ("fp8", "shadow", "training"),
    [({}, True, False), ({}, False, True), ({"enabled": True}, True, True)],
)
def test_a_run_trains_in_fp8_when_registered_so_or_read_from_a_recipe(
    session, fp8: dict, shadow: bool, training: bool
) -> None:
    """What the MFU ceiling of mfu_impossible follows (FP8 doubles the peak): a shadow tensor is
    what FP8 would see in a bf16 run, a recipe's tensor is FP8 training."""
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 1}, fp8=fp8))
    recs = [{"kind": "step", "step": 0, "ts": 100.0, "step_seconds": 1.0},
            {"kind": "tensor", "step": 0, "tensor": "fc", "role": "input", "format": "e4m3", "amax": 1.0,
             "headroom_bits": 3.0, "shadow": shadow}]  # fmt: skip
    batches.store_batch(session, Batch.model_validate({"run": "r", "rank": 0, "incarnation": 1, "seq": 0,
                                                      "records": recs}))  # fmt: skip
    run = queries.get_run(session, run_id="r")
    pipeline.reduce_steps(session, run, now=1e9, config=CONFIG)
    series = pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=DetectorInputs())
    assert [t.shadow for t in series.tensors] == [shadow]
    assert series.fp8_training is training


def _store_steps(session, run: str, steps: range, seq: int, rng: random.Random) -> None:
    recs = [r for s in steps for r in _records(0, s, 1, rng)]
    batches.store_batch(session, Batch.model_validate({"run": run, "rank": 0, "incarnation": 1, "seq": seq,
                                                      "records": recs}))  # fmt: skip


def test_the_registered_baseline_is_read_like_the_run_and_only_from_its_project(session, caplog) -> None:
    """The baseline's steps over the run's lookback, kept between cycles like the run's own (equal
    to a fresh read, also while the baseline is still running behind it); a run of another project
    is never read. (Project p's runs are stored under "p/<run>": store/run_keys.py.)"""
    rng = random.Random(3)
    for run, project, baseline in (("b", "p", None), ("x", "q", None), ("r", "p", "b"), ("r2", "p", "x")):
        batches.register_run(session, RunRegistration(run=run, project=project, baseline_run=baseline))
    _store_steps(session, "x", range(60), 0, rng)
    inputs = DetectorInputs()
    for cycle in range(8):
        _store_steps(session, "r", range(5 * cycle, 5 * cycle + 5), cycle, rng)
        _store_steps(session, "b", range(4 * cycle, 4 * cycle + 4), cycle, rng)  # behind the run
        for name in ("b", "r"):
            pipeline.reduce_steps(session, queries.get_run(session, run_id=f"p/{name}"), now=1e9, config=CONFIG)
        run = queries.get_run(session, run_id="p/r")
        cached = pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=inputs, rewritten_from=None)
        fresh = pipeline.build_series(session, run, now=1e9, config=CONFIG)
        _assert_same(cached, fresh)
        assert fresh.baseline is not None and fresh.baseline.run == "b"
        # The run's lookback, as far as the baseline has been reduced.
        assert list(fresh.baseline.steps.steps) == [s for s in fresh.steps.steps if s < 4 * cycle + 4]
    other = queries.get_run(session, run_id="p/r2")
    _store_steps(session, "r2", range(20), 0, rng)
    pipeline.reduce_steps(session, other, now=1e9, config=CONFIG)
    with caplog.at_level("WARNING"):
        assert pipeline.build_series(session, other, now=1e9, config=CONFIG).baseline is None
    assert "names baseline run x, which is not a run of project p" in caplog.text
    # A baseline registered after the run's first cycle is picked up by the next one.
    batches.register_run(session, RunRegistration(run="r3", project="p", baseline_run="late"))
    _store_steps(session, "r3", range(20), 0, rng)
    late = queries.get_run(session, run_id="p/r3")
    pipeline.reduce_steps(session, late, now=1e9, config=CONFIG)
    kept = DetectorInputs()
    assert pipeline.build_series(session, late, now=1e9, config=CONFIG, inputs=kept).baseline is None
    batches.register_run(session, RunRegistration(run="late", project="p"))
    _store_steps(session, "late", range(20), 0, rng)
    pipeline.reduce_steps(session, queries.get_run(session, run_id="p/late"), now=1e9, config=CONFIG)
    found = pipeline.build_series(session, late, now=1e9, config=CONFIG, inputs=kept, rewritten_from=None).baseline
    assert found is not None and len(found.steps.steps) == CONFIG.detector_lookback_steps


@pytest.mark.parametrize(("warmup", "found"), [(None, False), (20, True)])
def test_a_registered_warmup_is_what_the_live_analysis_applies(session, warmup: int | None, found: bool) -> None:
    """A 250-step run with a slow rank from the start: under the collector's warm-up (300 steps) it
    is never judged; registered with `detector_warmup_steps=20`, the live cycle finds the straggler."""
    run = f"short-{warmup}"
    batches.register_run(session, RunRegistration(run=run, parallelism={"world_size": 4}, detector_warmup_steps=warmup))
    for rank in range(4):
        compute = 1.5 if rank == 3 else 1.0
        records = [
            {"kind": "step", "step": s, "ts": 100.0 + 2 * s, "step_seconds": 1.6, "compute_seconds": compute,
             "wait_seconds": 1.6 - compute, "loss": 2.0, "pp_stage": 0}
            for s in range(250)
        ]  # fmt: skip
        batches.store_batch(session, Batch.model_validate({"run": run, "rank": rank, "incarnation": 1, "seq": 0,
                                                          "records": records}))  # fmt: skip
    pipeline.process_run(session, queries.get_run(session, run_id=run), now=700.0)
    kinds = {(f["kind"], f["subject"]) for f in queries.findings(session, run_id=run)}
    assert (("straggler", "3") in kinds) is found


def _view(session, run, inputs: DetectorInputs, upto: int | None):
    return inputs.build(session, run, rewritten_from=None, now=1e9, upto=upto,
                        lookback_steps=CONFIG.detector_lookback_steps,
                        rank_lookback_steps=CONFIG.straggler_lookback_steps)  # fmt: skip


def test_a_view_ending_at_upto_walks_a_stored_run(session) -> None:
    """`upto` ends the view at an earlier step (the analysis on request walks a stored run's
    history so): kept inputs stepped forward, and back, equal a fresh read ending there, the
    baseline's steps included; without it the view ends at the newest reduced step."""
    rng = random.Random(4)
    for run, baseline in (("b", None), ("r", "b")):
        batches.register_run(session, RunRegistration(run=run, baseline_run=baseline))
        _store_steps(session, run, range(60), 0, rng)
        pipeline.reduce_steps(session, queries.get_run(session, run_id=run), now=1e9, config=CONFIG)
    run = queries.get_run(session, run_id="r")
    kept = DetectorInputs()
    for upto in [*range(0, 60, 4), 59, 200, 30, 10, 45]:  # forward, past the newest step, back
        cached, fresh = _view(session, run, kept, upto), _view(session, run, DetectorInputs(), upto)
        _assert_same(cached, fresh)
        end = min(upto, 59)
        assert list(fresh.steps.steps) == list(range(max(end - CONFIG.detector_lookback_steps + 1, 0), end + 1))
        assert fresh.baseline is not None and list(fresh.baseline.steps.steps) == list(fresh.steps.steps)
        assert fresh.ranks is not None and fresh.ranks.steps[-1] == end
    _assert_same(_view(session, run, DetectorInputs(), None), _view(session, run, DetectorInputs(), 59))


def _timing(steps: range, value: float) -> list[np.ndarray]:
    """detector_reads.RANK_DTYPES columns: ranks 0 and 1 at each step, every time `value`."""
    step = np.repeat(np.array(steps, dtype=np.int64), 2)
    rank = np.tile(np.array([0, 1], dtype=np.int64), len(steps))
    ones = np.full(len(step), value)
    return [step, rank, ones, ones, ones, np.zeros(len(step))]


@pytest.mark.parametrize("spare_rows", [64, 1])
def test_rows_a_series_showed_are_not_written_again(monkeypatch, spare_rows: int) -> None:
    """The timing matrices grow into spare room; steps read again after late data (the newest
    steps cut, then appended anew) go to new rows, so the previous cycle's series keeps its values."""
    monkeypatch.setattr(detector_inputs, "_SPARE_ROWS", spare_rows)
    m = detector_inputs._RankMatrix()
    m.append(_timing(range(0, 6), 1.0))
    before = m.series()
    assert before is not None
    m.cut(after=-1, upto=3)  # steps 4 and 5 are re-read with new values
    m.append(_timing(range(4, 6), 2.0))
    m.append(_timing(range(6, 8), 3.0))  # and the next cycle's
    after = m.series()
    assert after is not None
    assert before.step_seconds[:, 0].tolist() == [1.0] * 6
    assert after.steps.tolist() == list(range(8))
    assert after.step_seconds[:, 1].tolist() == [1.0] * 4 + [2.0] * 2 + [3.0] * 2
    m.cut(after=5, upto=7)  # the window moves on: the oldest steps leave, the newest stay as they were
    assert m.series().step_seconds[:, 0].tolist() == [3.0, 3.0]
