"""The custom Collector: values from a store snapshot, no stale series, valid exposition."""

import pytest
from prometheus_client import generate_latest
from sqlalchemy import update

from trainvitals.service import exposition
from trainvitals.service.analysis import pipeline
from trainvitals.service.exposition import TrainvitalsCollector, make_registry
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db, queries
from trainvitals.service.store.models import Run
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
            records.append({"kind": "event", "event": "start", "ts": 0.5, "domains": {"host": f"node{rank // 2}"}})
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
    # The host comes from the rank's start event (ranks 2 and 3 on node1).
    slowest = {"run": "a", "rank": "3", "host": "node1"}
    assert sample("trainvitals_rank_slowest_compute_seconds", slowest) == 4.0
    assert sample("trainvitals_rank_slowest_cohort_ratio", slowest) == pytest.approx(4.0 / 2.5)
    assert sample("trainvitals_run_events_total", {"run": "a", "event": "start"}) == 4
    assert sample("trainvitals_run_events_total", {"run": "a", "event": "rank_lost"}) == 0
    assert sample("trainvitals_run_loss", {"run": "a"}) == pytest.approx(3.5)
    assert sample("trainvitals_run_tokens_per_second", {"run": "a"}) == pytest.approx(400 / 4.0)
    # counted by the ingest transactions themselves (ingest_counts): 4 batches of 3 steps + 1 event
    assert sample("trainvitals_ingest_records_total", {"run": "a"}) == 16
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


def _batch(maker, run: str, rank: int, incarnation: int, records: list[dict], seq: int = 0) -> None:
    with maker() as session:
        batches.store_batch(
            session,
            Batch.model_validate(
                {"run": run, "rank": rank, "incarnation": incarnation, "seq": seq, "records": records}
            ),
            now=1000.0,
        )


def test_run_events_count_restarts_and_ranks_lost_and_checkpoints_show_stall_and_persist(setup) -> None:
    maker, _clock, registry = setup
    with maker() as session:
        batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 2}), now=1000.0)
    start = {"kind": "event", "event": "start", "ts": 1.0}
    step = {"kind": "step", "ts": 1.0, "step_seconds": 1.0, "compute_seconds": 0.75, "loss": float("nan")}
    for rank in range(2):
        # incarnation 1 dies (no stop); 2 is the relaunch, which resumes and stops cleanly on rank 0
        # rank 1 reports its failure and closes its agent (which sends stop): still lost
        crash = [{"kind": "event", "event": e, "ts": 1.5} for e in ("failure", "stop")] if rank == 1 else []
        _batch(maker, "r", rank, 1, [start, {**step, "step": 0}, *crash])
        tail = [{"kind": "event", "event": "stop", "ts": 3.0}] if rank == 0 else []
        _batch(maker, "r", rank, 2, [start, {"kind": "event", "event": "resume", "ts": 2.0, "step": 0},
                                     {**step, "step": 1}, *tail])  # fmt: skip
        _batch(maker, "r", rank, 2, [
            {"kind": "checkpoint", "step": 1, "generation": 1, "status": "persisted", "ts": 2.5,
             "stall_seconds": 0.5 + rank, "persist_seconds": 4.0 - rank},
        ], seq=1)  # fmt: skip
    with maker() as session:
        pipeline.process_run(session, queries.get_run(session, run_id="r"), now=1000.0)
    events = {e: registry.get_sample_value("trainvitals_run_events_total", {"run": "r", "event": e})
              for e in ("start", "restart", "resume", "stop", "failure", "rank_lost")}  # fmt: skip
    # 4 start events: 2 ranks (start) started again once each (restart); both first incarnations
    # ended without a stop (rank_lost); a stop of the newest incarnation is a clean end, not a loss.
    assert events == {"start": 2, "restart": 2, "resume": 2, "stop": 2, "failure": 1, "rank_lost": 2}
    sample = registry.get_sample_value
    assert sample("trainvitals_checkpoint_last_stall_seconds", {"run": "r"}) == 1.5  # the slowest rank's
    assert sample("trainvitals_checkpoint_last_persist_seconds", {"run": "r"}) == 4.0
    assert sample("trainvitals_run_loss_nonfinite_ranks", {"run": "r"}) == 2
    assert sample("trainvitals_run_rank_compute_seconds", {"run": "r"}) == 0.75


def test_the_stall_age_runs_from_the_newest_step_record_stored_and_follows_a_relaunch(setup) -> None:
    """Seconds since the last step: since the collector last stored a step record of the run, on its
    own clock. By the newest step's own end time, a relaunch resuming from a checkpoint (steps
    below the newest) aged from the crash until it passed the newest step (a stall page for a run
    that trains), and an agent clock behind the collector's aged every run by the difference."""
    maker, clock, registry = setup
    with maker() as session:
        batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 1}), now=1000.0)

    def store(incarnation: int, seq: int, records: list[dict], now: float) -> None:
        with maker() as session:
            batch = {"run": "r", "rank": 0, "incarnation": incarnation, "seq": seq, "records": records}
            batches.store_batch(session, Batch.model_validate(batch), now=now)

    def steps(first: int, last: int, ts: float) -> list[dict]:
        return [{"kind": "step", "step": s, "ts": ts, "step_seconds": 1.0} for s in range(first, last + 1)]

    def since() -> float | None:
        return registry.get_sample_value("trainvitals_run_seconds_since_last_step", {"run": "r"})

    store(1, 0, steps(95, 100, ts=1000.0 - 3600), now=1000.0)  # its clock an hour behind
    clock.now = 1030.0
    assert since() == 30.0
    # It crashes at step 100; relaunched 10 minutes later, it resumes from step 90.
    store(2, 0, steps(90, 93, ts=1600.0), now=1600.0)
    clock.now = 1610.0
    assert since() == 10.0
    assert registry.get_sample_value("trainvitals_run_latest_step", {"run": "r"}) == 100.0
    # Then it hangs: records that are not steps do not reset the age.
    store(2, 1, [{"kind": "event", "event": "dropped", "ts": 1700.0, "domains": {"queue_full": "1"}}], now=1700.0)
    clock.now = 1900.0
    assert since() == 300.0
    # A run whose steps all came before revision 0018 (last_step_at NULL): the newest step's end time.
    with maker() as session:
        session.execute(update(Run).values(last_step_at=None))
        session.commit()
    assert since() == 1900.0 - 1000.0 + 3600


def test_a_stalled_run_is_exported_before_the_runs_still_stepping() -> None:
    """The per-project cap keeps the most recently seen runs; a run that stops stepping stops being
    seen, so it was the first left out, and TrainvitalsRunStalled (which reads its series) could
    not fire for it."""
    now = 10_000.0

    def run(name: str, ago: float, stepped_ago: float | None) -> Run:
        last_step_at = None if stepped_ago is None else now - stepped_ago
        return Run(run_id=name, project="p", status="running", last_seen_at=now - ago, last_step_at=last_step_at)

    stepping = [run(f"s{i:02d}", i, i) for i in range(60)]
    hung = run("hung", 900, 900)
    hung_but_seen = run("hung-but-seen", 0, 500)  # its agents still send (events), no steps
    loading = run("loading", 900, None)  # registered, no step yet: nothing to call stalled
    kept, omitted = exposition._exported_runs([*stepping, loading, hung, hung_but_seen], {}, now)
    assert [r.run_id for r in kept[:2]] == ["hung-but-seen", "hung"]
    assert [r.run_id for r in kept[2:]] == [f"s{i:02d}" for i in range(exposition.EXPORTED_RUNS_PER_PROJECT - 2)]
    assert omitted == {"p": 63 - exposition.EXPORTED_RUNS_PER_PROJECT}


def test_records_the_agents_dropped_are_exported_by_reason_from_their_cumulative_events(setup) -> None:
    maker, _clock, registry = setup
    with maker() as session:
        batches.register_run(session, RunRegistration(run="r", parallelism={"world_size": 2}), now=1000.0)

    def dropped(ts: float, **counts: int) -> dict:
        return {"kind": "event", "event": "dropped", "ts": ts, "domains": {k: str(n) for k, n in counts.items()}}

    # rank 0, incarnation 1: cumulative 10 then 30 spool_error -> 30, not 40; its relaunch lost 5 more
    _batch(maker, "r", 0, 1, [dropped(1.0, spool_error=10), dropped(2.0, spool_error=30, queue_full=2)])
    _batch(maker, "r", 0, 2, [dropped(3.0, spool_error=5)])
    # rank 1: a reason this collector does not know is summed under "other"
    _batch(maker, "r", 1, 1, [dropped(1.0, queue_full=1, disk_on_fire=7)])
    family = "trainvitals_run_agent_dropped_records_total"
    value = {reason: registry.get_sample_value(family, {"run": "r", "reason": reason})
             for reason in ("spool_error", "queue_full", "spool_full", "exit_timeout", "other")}  # fmt: skip
    assert value == {"spool_error": 35, "queue_full": 3, "spool_full": 0, "exit_timeout": 0, "other": 7}


def test_mfu_prediction_interval_is_exported_as_a_band(db_url: str) -> None:
    from trainvitals.service.analysis.expectations import MfuExpectation

    engine = db.make_engine(db_url)
    maker = db.make_sessionmaker(engine)
    collector = TrainvitalsCollector(
        maker, Settings(db=db_url), clock=Clock(1000.0), mfu_expectation=lambda _r: MfuExpectation(0.4, 0.35, 0.46)
    )
    registry = make_registry(collector)
    _store(maker, "b", ranks=1, steps=2)
    assert registry.get_sample_value("trainvitals_run_mfu_expected_ratio", {"run": "b"}) == 0.4
    assert registry.get_sample_value("trainvitals_run_mfu_expected_band_ratio", {"run": "b", "bound": "low"}) == 0.35
    assert registry.get_sample_value("trainvitals_run_mfu_expected_band_ratio", {"run": "b", "bound": "high"}) == 0.46
    engine.dispose()


def test_analysis_cycles_are_counted_in_the_database_and_exported_by_any_process(setup, db_url: str) -> None:
    from trainvitals.service.analysis.worker import AnalysisWorker

    maker, clock, registry = setup
    _store(maker, "w", ranks=1, steps=2)
    assert registry.get_sample_value("trainvitals_analysis_cycles_total") == 0  # no cycle yet
    worker = AnalysisWorker(maker, Settings(db=db_url), clock=clock)  # another "process"'s worker
    worker.run_once()
    worker.run_once()
    clock.now += 5
    sample = registry.get_sample_value
    assert sample("trainvitals_analysis_cycles_total") == 2
    assert sample("trainvitals_analysis_errors_total") == 0
    assert sample("trainvitals_analysis_cycle_seconds_total") > 0
    assert sample("trainvitals_analysis_seconds_since_last_cycle") == 5


def test_open_findings_export_their_kept_onset_detected_and_paged_step(setup) -> None:
    from trainvitals.service.detectors.findings import Finding
    from trainvitals.service.store import findings

    maker, _clock, registry = setup
    _store(maker, "f", ranks=2, steps=2)
    straggler = {"run": "f", "kind": "straggler", "severity": "page", "subject_kind": "rank", "subject": "1",
                 "magnitude": 1.3, "summary": "rank 1 slow since step 600", "active": True}  # fmt: skip
    with maker() as session:
        ticket = Finding(**{**straggler, "kind": "straggler_intermittent", "severity": "ticket"}, onset_step=600,
                         last_step=700)  # fmt: skip
        findings.store_findings(
            session, run_id="f", findings=[Finding(**straggler, onset_step=600, last_step=700, paged_step=680), ticket],
            now=1000.0,
        )
        # The next cycle's lookback has slid past step 600: the recomputed onset and page step are later.
        later = Finding(**straggler, onset_step=900, last_step=1000, paged_step=950)
        findings.store_findings(session, run_id="f", findings=[later, ticket], now=1001.0)
    labels = {"run": "f", "kind": "straggler", "subject_kind": "rank", "subject": "1"}
    assert registry.get_sample_value("trainvitals_finding_onset_step", labels) == 600
    assert registry.get_sample_value("trainvitals_finding_detected_step", labels) == 700
    assert registry.get_sample_value("trainvitals_finding_paged_step", labels) == 680
    assert registry.get_sample_value("trainvitals_finding_active", {**labels, "severity": "page"}) == 1
    # A ticket that has not paged has no page step (no series, not 0).
    ticket_labels = {**labels, "kind": "straggler_intermittent"}
    assert registry.get_sample_value("trainvitals_finding_detected_step", ticket_labels) == 700
    assert registry.get_sample_value("trainvitals_finding_paged_step", ticket_labels) is None


def test_checkpoint_advice_is_cached_a_minute_and_its_absence_ten_seconds(db_url: str) -> None:
    from types import SimpleNamespace

    engine = db.make_engine(db_url)
    maker = db.make_sessionmaker(engine)
    clock = Clock(1000.0)
    answers = [None, SimpleNamespace(recommended_interval_s=600.0, band_s=(500.0, 700.0))]
    calls: list[float] = []

    def advice(_session, *, run_id: str, registration: dict) -> object:
        calls.append(clock.now)
        return answers[min(len(calls) - 1, 1)]

    collector = TrainvitalsCollector(maker, Settings(db=db_url), clock=clock, checkpoint_advice=advice)
    registry = make_registry(collector)
    _store(maker, "c", ranks=1, steps=2)
    interval = ("trainvitals_checkpoint_recommended_interval_seconds", {"run": "c"})
    assert registry.get_sample_value(*interval) is None  # not enough to advise yet
    clock.now += 5
    assert registry.get_sample_value(*interval) is None and len(calls) == 1  # asked again after 10 s only
    clock.now += 6
    assert registry.get_sample_value(*interval) == 600.0 and len(calls) == 2  # the first save's advice
    clock.now += 50
    registry.get_sample_value(*interval)
    assert len(calls) == 2  # advice is kept a minute
    engine.dispose()


def test_an_advisor_that_raises_leaves_the_scrape_whole(db_url: str, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint advice that raised anything but ValueError (a MemoryError from a fitted Weibull
    shape near 0) failed the whole scrape: every series of every run, and every alert with them."""
    engine = db.make_engine(db_url)
    maker = db.make_sessionmaker(engine)

    def advice(_session, *, run_id: str, registration: dict) -> object:
        raise MemoryError("Unable to allocate 46.3 GiB")

    collector = TrainvitalsCollector(maker, Settings(db=db_url), clock=Clock(1000.0), checkpoint_advice=advice)
    registry = make_registry(collector)
    _store(maker, "c", ranks=1, steps=2)
    assert registry.get_sample_value("trainvitals_run_latest_step", {"run": "c"}) == 1.0
    assert registry.get_sample_value("trainvitals_checkpoint_recommended_interval_seconds", {"run": "c"}) is None
    assert "checkpoint advice for run" in caplog.text and "MemoryError" in caplog.text
    engine.dispose()


def _fp8(step: int, tensor: str, role: str, crest: float | None, fmt: str = "e4m3") -> dict:
    return {"kind": "tensor", "step": step, "tensor": tensor, "role": role, "format": fmt, "amax": 1.0,
            "scale": 1.0, "headroom_bits": 4.0, "crest_bits": crest}  # fmt: skip


def test_the_widest_e4m3_crest_of_the_newest_step_that_measured_one_is_exported(setup, db_url: str) -> None:
    """Crest is measured on the agent's expensive steps only: the gauge holds the newest such step's
    E4M3 tensors (max over ranks), not the newest FP8 step's (no crest there), and leaves out
    E5M2 (not judged) and a crest that is not a number."""
    maker, _clock, registry = setup
    _store(maker, "c", ranks=2, steps=6)
    for rank, wide in ((0, 13.0), (1, 10.0)):
        expensive = [
            _fp8(2, "layers.0.fc1", "input", wide),
            _fp8(2, "layers.1.fc1", "weight", 9.0),
            _fp8(2, "layers.0.fc1", "grad_output", 20.0, fmt="e5m2"),
            _fp8(2, "layers.2.fc1", "input", float("nan")),
        ]
        ordinary = [_fp8(s, "layers.0.fc1", "input", None) for s in (3, 4, 5)]
        _batch(maker, "c", rank, 1, expensive + ordinary, seq=1)
    with maker() as session:
        pipeline.process_run(session, queries.get_run(session, run_id="c"), now=1000.0)
    text = generate_latest(registry).decode()
    crests = {
        line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("trainvitals_fp8_worst_crest_log2{")
    }
    assert crests == {
        'role="input",run="c",tensor="layers.0.fc1"': 13.0,
        'role="weight",run="c",tensor="layers.1.fc1"': 9.0,
    }
    assert registry.get_sample_value("trainvitals_fp8_crest_step", {"run": "c"}) == 2
    assert registry.get_sample_value("trainvitals_fp8_step", {"run": "c"}) == 5

    # A newer expensive step replaces the set: only what it measured.
    step_6 = {"kind": "step", "step": 6, "ts": 1.0, "step_seconds": 1.0, "loss": 5.0, "tokens": 100}
    for rank in (0, 1):
        _batch(maker, "c", rank, 1, [step_6, _fp8(6, "layers.1.fc1", "weight", 5.0)], seq=2)
    with maker() as session:
        pipeline.process_run(session, queries.get_run(session, run_id="c"), now=1000.0)
    sample = registry.get_sample_value
    assert sample("trainvitals_fp8_crest_step", {"run": "c"}) == 6
    assert sample("trainvitals_fp8_worst_crest_log2", {"run": "c", "tensor": "layers.1.fc1", "role": "weight"}) == 5
    assert sample("trainvitals_fp8_worst_crest_log2", {"run": "c", "tensor": "layers.0.fc1", "role": "input"}) is None


def test_the_newest_measured_crest_is_found_through_its_partial_index(db_url: str) -> None:
    """The scrape's read of the newest step with a crest seeks the partial index of the measured rows
    (migration 0019) instead of reading back over every tensor row of up to 200 steps."""
    engine = db.make_engine(db_url)
    sql = "SELECT max(step) FROM tensor_summaries WHERE run_id = 'r' AND crest_bits IS NOT NULL"
    with engine.connect() as conn:
        if engine.dialect.name == "sqlite":
            plan = " ".join(str(row[-1]) for row in conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {sql}"))
        else:
            conn.exec_driver_sql("SET enable_seqscan = off")  # an empty table: make the index the planner's choice
            plan = " ".join(row[0] for row in conn.exec_driver_sql(f"EXPLAIN {sql}"))
    engine.dispose()
    assert "ix_tensor_summaries_run_crest_step" in plan
