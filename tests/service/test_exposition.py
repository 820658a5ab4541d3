"""The custom Collector: values from a store snapshot, no stale series, valid exposition."""

import pytest
from prometheus_client import generate_latest

from trainvitals.service.analysis import pipeline
from trainvitals.service.exposition import TrainvitalsCollector, make_registry
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db, queries
from trainvitals.wire import Batch, RunRegistration


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def setup(db_url: str):
    engine = db.make_engine(db_url)
    maker = db.make_sessionmaker(engine)
    clock = Clock(1000.0)
    settings = Settings(db=db_url, finished_run_grace_seconds=60, idle_run_seconds=600)
    registry = make_registry(TrainvitalsCollector(maker, settings, clock=clock))
    yield maker, clock, registry
    engine.dispose()


def _store(maker, run: str, ranks: int, steps: int, *, stop: bool = False, now: float = 1000.0) -> None:
    with maker() as session:
        batches.register_run(session, RunRegistration(run=run, parallelism={"world_size": ranks}), now=now)
        for rank in range(ranks):
            records = [
                {
                    "kind": "step",
                    "step": s,
                    "ts": 1.0,
                    "step_seconds": 1.0 + rank,
                    "loss": 5.0 - rank,
                    "tokens": 100,
                }
                for s in range(steps)
            ]
            if stop:
                records.append({"kind": "event", "event": "stop", "ts": 2.0})
            batches.store_batch(
                session,
                Batch.model_validate(
                    {"run": run, "rank": rank, "incarnation": 1, "seq": 0, "records": records}
                ),
                now=now,
            )
        pipeline.process_run(session, queries.get_run(session, run_id=run), now=now)


def test_values_reduce_across_ranks(setup) -> None:
    maker, _clock, registry = setup
    _store(maker, "a", ranks=4, steps=3)
    sample = registry.get_sample_value
    assert sample("trainvitals_run_latest_step", {"run": "a"}) == 2
    assert sample("trainvitals_run_complete_step", {"run": "a"}) == 2
    assert sample("trainvitals_run_ranks_reporting", {"run": "a"}) == 4
    assert sample("trainvitals_run_rank_step_seconds", {"run": "a", "stat": "max"}) == 4.0
    assert sample("trainvitals_run_rank_step_seconds", {"run": "a", "stat": "p50"}) == 2.5
    assert sample("trainvitals_run_rank_step_seconds", {"run": "a", "stat": "p90"}) == pytest.approx(3.7)
    # Top-k slowest ranks, relative to the cohort median (no pipeline stages: one cohort).
    assert sample("trainvitals_rank_slowest_compute_seconds", {"run": "a", "rank": "3"}) == 4.0
    assert sample("trainvitals_rank_slowest_cohort_ratio", {"run": "a", "rank": "3"}) == pytest.approx(
        4.0 / 2.5
    )
    assert sample("trainvitals_run_loss", {"run": "a"}) == pytest.approx(3.5)
    assert sample("trainvitals_run_tokens_per_second", {"run": "a"}) == pytest.approx(400 / 4.0)
    # counted by the ingest transactions themselves (ingest_counts): 4 batches of 3 records
    assert sample("trainvitals_ingest_records_total", {"run": "a"}) == 12
    assert sample("trainvitals_ingest_batches_total", {"outcome": "stored"}) == 4


def test_finished_runs_leave_after_the_grace_and_idle_runs_after_the_timeout(setup) -> None:
    maker, clock, registry = setup
    _store(maker, "done", ranks=1, steps=2, stop=True)
    _store(maker, "idle", ranks=1, steps=2)
    assert (
        registry.get_sample_value(
            "trainvitals_run_info", {"run": "done", "project": "default", "status": "finished"}
        )
        == 1
    )
    clock.now += 61  # past the finished grace, within the idle timeout
    text = generate_latest(registry).decode()
    assert 'run="done"' not in text and 'run="idle"' in text
    clock.now += 600
    assert 'run="idle"' not in generate_latest(registry).decode()


def test_deleted_run_disappears(setup) -> None:
    maker, _clock, registry = setup
    _store(maker, "gone", ranks=2, steps=2)
    assert registry.get_sample_value("trainvitals_run_latest_step", {"run": "gone"}) == 1
    with maker() as session:
        queries.delete_run(session, run_id="gone")
    assert 'run="gone"' not in generate_latest(registry).decode()


def test_exposition_passes_promtool(setup, promtool_check) -> None:
    maker, _clock, registry = setup
    _store(maker, "a", ranks=3, steps=4)
    result = promtool_check(generate_latest(registry).decode())
    assert result.returncode == 0, result.stdout + result.stderr


def test_mfu_is_total_flops_over_time_and_stored_peak_of_the_newest_20_steps(setup) -> None:
    maker, _clock, registry = setup
    with maker() as session:
        registration = RunRegistration(
            run="m", parallelism={"world_size": 2}, hardware={"gpu_count": 2, "peak_flops": 1e10}
        )
        batches.register_run(session, registration, now=1000.0)
        for rank in range(2):
            records = [
                {"kind": "step", "step": s, "ts": 1.0, "step_seconds": 1.0 + rank + s, "flops": 1e9} for s in range(30)
            ]
            batches.store_batch(
                session,
                Batch.model_validate({"run": "m", "rank": rank, "incarnation": 1, "seq": 0, "records": records}),
                now=1000.0,
            )
        pipeline.process_run(session, queries.get_run(session, run_id="m"), now=1000.0)
    # Steps 10..29: job FLOPs 2e9 each, the slowest rank takes 2 + s seconds, peak 2 x 1e10 FLOP/s.
    expected = 20 * 2e9 / (sum(2.0 + s for s in range(10, 30)) * 2e10)
    assert registry.get_sample_value("trainvitals_run_mfu_ratio", {"run": "m"}) == pytest.approx(expected)
