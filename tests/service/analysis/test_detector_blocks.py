"""Stored blocks of the detector input (store/detector_blocks.py): a worker that starts without
memory (a collector start, a lease takeover) and loads them builds exactly the input of a fresh
read of the rows, cycle after cycle, through late data that rewrites stored steps, a restart that
replays steps, a rank that joins late and lookbacks that blocks leave; and the first build after a
start reads only the rows no block holds."""

import random

import numpy as np
import pytest
from sqlalchemy import select

from tests.service.analysis.test_detector_inputs import _assert_same, _records
from trainvitals.service.analysis import detector_inputs, pipeline
from trainvitals.service.analysis.detector_inputs import DetectorInputs
from trainvitals.service.store import batches, detector_blocks, detector_reads, queries
from trainvitals.service.store.models import DetectorBlock
from trainvitals.wire import Batch, RunRegistration

WORLD = 4
CONFIG = pipeline.PipelineConfig(settle_seconds=5.0, detector_lookback_steps=15, straggler_lookback_steps=7)


@pytest.fixture(autouse=True)
def _small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(detector_inputs.BLOCK_STEPS, "summaries", 5)
    monkeypatch.setitem(detector_inputs.BLOCK_STEPS, "tensors", 4)
    monkeypatch.setitem(detector_inputs.BLOCK_STEPS, "timing", 3)


def _store(session, rank: int, steps: range, inc: int, seq: int, rng: random.Random) -> None:
    recs = [r for s in steps for r in _records(rank, s, inc, rng)]
    batch = Batch.model_validate({"run": "r", "rank": rank, "incarnation": inc, "seq": seq, "records": recs})
    batches.store_batch(session, batch)


@pytest.mark.parametrize("seed", [3, 4])
def test_a_restarted_worker_loading_blocks_builds_what_a_fresh_read_does(session, seed: int) -> None:
    rng = random.Random(seed)
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": WORLD},
                                                 hardware={"gpu_count": WORLD, "peak_flops": 1e10}))  # fmt: skip
    sent, seq, inc = dict.fromkeys(range(WORLD), 0), dict.fromkeys(range(WORLD), 0), dict.fromkeys(range(WORLD), 1)
    kept = DetectorInputs(blocks=True)
    loaded_blocks = 0
    for cycle in range(14):
        n = rng.randint(2, 5)
        for rank in range(WORLD):
            if rank == 3 and cycle < 3:
                continue  # joins late
            if rank == 3 and cycle == 3:
                sent[3] = sent[0] - n
            k = n
            if rank == 2 and cycle in (5, 6):
                continue  # an outage: its steps arrive late and rewrite stored blocks
            if rank == 2 and cycle == 7:
                k += sent[0] - n - sent[2]
            if rank == 1 and cycle == 9:
                inc[1] += 1  # restart: steps replayed, the newest incarnation wins
                sent[1] -= 6
                k += 6
            _store(session, rank, range(sent[rank], sent[rank] + k), inc[rank], seq[rank], rng)
            sent[rank] += k
            seq[rank] += 1
        now = 100.0 + max(sent.values()) + rng.choice([0.0, 10.0])
        run = queries.get_run(session, run_id="r")
        _, first = pipeline.reduce_steps(session, run, now=now, config=CONFIG)
        live = pipeline.build_series(session, run, now=now, config=CONFIG, inputs=kept, rewritten_from=first)
        restarted = DetectorInputs(blocks=True)  # a new lease holder: blocks, then rows
        loaded = pipeline.build_series(session, run, now=now, config=CONFIG, inputs=restarted)
        loaded_blocks += sum(len(firsts) for firsts in restarted._stored.values())  # type: ignore[union-attr]
        fresh = pipeline.build_series(session, run, now=now, config=CONFIG)
        _assert_same(live, fresh)
        _assert_same(loaded, fresh)
    assert loaded_blocks > 20  # the restarted builds did load blocks
    # Blocks that left the lookbacks are gone; the stored ones are the newest.
    newest = detector_reads.newest_summary(session, run_id="r")
    assert newest is not None
    timing = detector_blocks.stored(session, run_id="r", source="timing")
    assert timing and min(timing) > newest[0] - CONFIG.straggler_lookback_steps - 3


def test_the_first_build_after_a_start_reads_rows_only_where_no_block_is(session, monkeypatch) -> None:
    rng = random.Random(5)
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": WORLD}))
    for rank in range(WORLD):
        _store(session, rank, range(0, 30), 1, 0, rng)
    run = queries.get_run(session, run_id="r")
    pipeline.reduce_steps(session, run, now=1e9, config=CONFIG)
    for _ in range(4):  # a few cycles store the blocks (two per source and cycle)
        pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=DetectorInputs(blocks=True))
    reads: list[tuple[str, int, int]] = []
    for name in ("rank_timing_columns", "tensor_rows", "step_columns", "group_norm_columns"):
        real = getattr(detector_reads, name)

        def spy(*args, _real=real, _name=name, **kw):  # type: ignore[no-untyped-def]
            reads.append((_name, kw["after"], kw["upto"]))
            return _real(*args, **kw)

        monkeypatch.setattr(detector_reads, name, spy)
    series = pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=DetectorInputs(blocks=True))
    # Steps 0..29: timing lookback 23..29 (blocks of 3: 24..26, 27..29 stored; 23 from rows);
    # tensors 15..29 (blocks of 4: 16..19, 20..23, 24..27 stored; 15 and 28..29 from rows);
    # summaries 15..29 (blocks of 5: 15..19, 20..24, 25..29 stored; no rows).
    assert sorted(reads) == [("rank_timing_columns", 22, 23), ("tensor_rows", 14, 15), ("tensor_rows", 27, 29)]
    fresh = pipeline.build_series(session, run, now=1e9, config=CONFIG)
    _assert_same(series, fresh)


def test_blocks_of_runs_that_left_the_live_set_are_deleted(session) -> None:
    import numpy as np

    for run in ("live", "done"):
        batches.register_run(session, RunRegistration(run=run), now=0.0)
        payload = detector_blocks.encode({"x": np.zeros(3)})
        detector_blocks.save(session, run_id=run, source="timing", first=0, last=2, payload=payload)
    session.commit()
    detector_blocks.forget_runs_except(session, live=["live"])
    assert detector_blocks.stored(session, run_id="live", source="timing") == {0}
    assert detector_blocks.stored(session, run_id="done", source="timing") == set()


def test_sqlite_blocks_are_built_before_the_write_lock_is_taken(tmp_path, monkeypatch, write_lock_probe) -> None:
    """Saving a block takes SQLite's one write lock until the cycle's commit, and ingest's writer (in
    another process) waits for it: every block of a cycle (two per source here) is built and encoded
    first, so a second connection finds the lock free whenever a block's arrays are made."""
    from trainvitals.service.store import db

    url = f"sqlite:///{tmp_path}/tv.db"
    db.upgrade(url)
    engine = db.make_engine(url)
    probe = write_lock_probe(tmp_path / "tv.db")
    real_tensor, real_encode = DetectorInputs._tensor_block, detector_blocks.encode
    monkeypatch.setattr(DetectorInputs, "_tensor_block", lambda self, *a: (probe(), real_tensor(self, *a))[1])
    monkeypatch.setattr(detector_blocks, "encode", lambda arrays: (probe(), real_encode(arrays))[1])
    rng = random.Random(6)
    try:
        with db.make_sessionmaker(engine)() as session:
            batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": WORLD}))
            for rank in range(WORLD):
                _store(session, rank, range(0, 30), 1, 0, rng)
            run = queries.get_run(session, run_id="r")
            pipeline.reduce_steps(session, run, now=1e9, config=CONFIG)
            session.commit()
            inputs = DetectorInputs(blocks=True)
            pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=inputs)
            sources = ("summaries", "tensors", "timing")
            saved = {src: detector_blocks.stored(session, run_id="r", source=src) for src in sources}
    finally:
        engine.dispose()
    assert saved == {"summaries": {20, 25}, "tensors": {20, 24}, "timing": {24, 27}}  # the newest two of each
    locked = probe.locked
    assert len(locked) == 2 + 6 and not any(locked), locked  # 2 tensor blocks built, 6 blocks encoded


def test_tensor_blocks_stored_before_the_crest_column_still_load(session) -> None:
    """Blocks written before crest_bits was a detector input hold seven tensor columns: a worker
    that starts after the upgrade loads them, crest unknown (NaN) on their steps, the rest exact."""
    rng = random.Random(7)
    batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": WORLD},
                                                 hardware={"gpu_count": WORLD, "peak_flops": 1e10}))  # fmt: skip
    for rank in range(WORLD):
        _store(session, rank, range(24), 1, 0, rng)
    run = queries.get_run(session, run_id="r")
    _, first = pipeline.reduce_steps(session, run, now=1e9, config=CONFIG)
    kept = DetectorInputs(blocks=True)  # stores the blocks, as the worker did before the upgrade
    pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=kept, rewritten_from=first)
    covered: list[tuple[int, int]] = []
    for block in session.scalars(select(DetectorBlock).where(DetectorBlock.source == "tensors")):
        arrays = detector_blocks.decode(block.payload)
        covered.append((block.first_step, block.last_step))
        block.payload = detector_blocks.encode({k: v for k, v in arrays.items() if k != "c7"})
    session.commit()
    assert covered
    loaded = pipeline.build_series(session, run, now=1e9, config=CONFIG, inputs=DetectorInputs(blocks=True))
    fresh = pipeline.build_series(session, run, now=1e9, config=CONFIG)
    (t_loaded,) = [t for t in loaded.tensors if t.tensor == "layers.0.fc"]
    (t_fresh,) = [t for t in fresh.tensors if t.tensor == "layers.0.fc"]
    in_blocks = np.zeros(len(t_fresh.steps), dtype=bool)
    for a, b in covered:
        in_blocks |= (t_fresh.steps >= a) & (t_fresh.steps <= b)
    same = (t_loaded.crest_bits == t_fresh.crest_bits) | (np.isnan(t_loaded.crest_bits) & np.isnan(t_fresh.crest_bits))
    unknown = np.isnan(t_loaded.crest_bits) & np.isfinite(t_fresh.crest_bits)
    assert unknown.any()  # loaded from the old blocks: crest not known there
    assert (same | (unknown & in_blocks)).all()  # and only there; every other step as a fresh read
    for t in loaded.tensors:  # everything else as a fresh read
        t.crest_bits = next(f.crest_bits for f in fresh.tensors if (f.tensor, f.role) == (t.tensor, t.role))
    _assert_same(loaded, fresh)
