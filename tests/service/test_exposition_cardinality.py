"""/metrics stays bounded whatever agents send: each cardinality attack of issue 15, driven
through the store's ingest path on both backends, with the series bound and the scrape time.

The scrape is timed in process (generate_latest over the collector: the database reads and the
text, which is all a scrape does besides HTTP); the times are printed (pytest -s), and asserted
under half of Prometheus's default scrape timeout (the scrape's cost is per exported run).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trainvitals.service import exposition
from trainvitals.service.analysis import pipeline
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.exposition import TrainvitalsCollector, make_registry
from trainvitals.service.settings import Settings
from trainvitals.service.store import batches, db, findings, queries, run_keys
from trainvitals.service.store.models import Run
from trainvitals.wire import Batch, RunRegistration
from trainvitals.wire.conventions import DROP_REASONS

NOW = 10_000.0
# Half of Prometheus's default 10 s scrape timeout: generous, as the machine running the suite
# may be shared (docs/metrics.md gives measured times).
SCRAPE_BUDGET_S = 5.0

# The worst case of one run's series with the default settings (top_k 10, max_grad_groups 256),
# family by family, as docs/metrics.md states it.
TOP_K, GRAD_GROUPS, FINDING_KINDS, EVENTS, ROLES = 10, 256, 24, 11, 3
PER_RUN_BOUND = (
    27  # one series each: run_info, run_world_size_ranks, ... ingest_records
    + 5  # rank_step_seconds stats
    + 2 + 2  # mfu band, checkpoint interval band
    + EVENTS
    + len(DROP_REASONS) + 1  # agent_dropped_records by reason, plus "other"
    + 4  # checkpoint records by status
    + exposition.STAGES_PER_RUN + 1
    + GRAD_GROUPS
    + (exposition.FP8_LAYERS_PER_RUN + 1) * ROLES
    + TOP_K  # worst tensors
    + TOP_K  # widest crests
    + 2 * TOP_K  # slowest ranks
    + 4 * exposition.OPEN_FINDINGS_PER_RUN
    + FINDING_KINDS * 3  # findings_total by kind and severity
)


def _collector(db_url: str):
    engine = db.make_engine(db_url)
    maker = db.make_sessionmaker(engine)
    collector = TrainvitalsCollector(maker, Settings(db=db_url, idle_run_seconds=3600), clock=lambda: NOW)
    return engine, maker, collector


def _scrape(registry) -> tuple[str, float]:
    """The exposition text and the median of three timed scrapes (after one warm-up)."""
    generate_latest(registry)
    times, text = [], ""
    for _ in range(3):
        t0 = time.perf_counter()
        text = generate_latest(registry).decode()
        times.append(time.perf_counter() - t0)
    return text, sorted(times)[1]


Series = dict[str, dict[tuple[tuple[str, str], ...], float]]


def _series(text: str) -> Series:
    """Sample name -> its label sets (sorted pairs) -> value, read from one scrape's text (every
    registry.get_sample_value would be a scrape of its own); fails on a repeated label set
    (Prometheus would reject the whole scrape)."""
    out: Series = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted(sample.labels.items()))
            assert labels not in out.get(sample.name, {}), f"{sample.name} repeats {labels}"
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def _value(series: Series, name: str, **labels: str) -> float | None:
    return series.get(name, {}).get(tuple(sorted(labels.items())))


def _label(series: Series, name: str, label: str) -> set[str]:
    return {dict(labels)[label] for labels in series[name]}


def _of_run(series: Series, run: str) -> Counter[str]:
    return Counter(
        {name: n for name, sets in series.items() if (n := sum(("run", run) in labels for labels in sets))}
    )


def _batch(session, run: str, rank: int, records: list[dict], seq: int = 0) -> None:
    batches.store_batch(
        session,
        Batch.model_validate({"run": run, "rank": rank, "incarnation": 1, "seq": seq, "records": records}),
        now=NOW,
    )


def test_layer_and_stage_attack_on_one_run_is_capped(db_url: str) -> None:
    """5,000 layer-style tensor names and 2,000 pp_stage values (the issue's 7,000 series): the
    64 layers with the least headroom plus layer="other", the 64 slowest registered stages plus
    stage="other", and the 1,000 stage numbers beyond the registered pp counted, not exported."""
    engine, maker, collector = _collector(db_url)
    ranks, pp, tensors = 2_000, 1_000, 5_000
    with maker() as session:
        reg = RunRegistration(run="attack", parallelism={"world_size": ranks, "pp": pp})
        batches.register_run(session, reg, now=NOW)
        for rank in range(ranks):
            step = {"kind": "step", "step": 0, "ts": NOW - 1, "step_seconds": 1.0 + rank / 1000, "pp_stage": rank}
            _batch(session, "attack", rank, [step])
        fp8 = {"kind": "tensor", "step": 0, "role": "input", "format": "e4m3", "amax": 1.0, "scale": 1.0}
        records = [
            {**fp8, "tensor": f"blocks.{i}.mlp.fc", "headroom_bits": 8.0 - i / 1000, "crest_bits": 10.0 + i / 1000}
            for i in range(tensors)
        ]
        # A real layer named like the summary series: it must join the summary, not repeat its labels.
        records.append({**fp8, "tensor": "other.proj", "headroom_bits": 20.0})
        _batch(session, "attack", 0, records, seq=1)
        pipeline.process_run(session, queries.get_run(session, run_id="attack"), now=NOW)
    registry = make_registry(collector)
    text, seconds = _scrape(registry)
    series = _series(text)
    per_family = _of_run(series, "attack")
    print(f"\n[{db_url.split(':')[0]}] layer+stage attack: {sum(per_family.values())} series, scrape {seconds:.3f} s")

    layers = _label(series, "trainvitals_fp8_layer_min_headroom_log2", "layer")
    assert layers == {f"blocks.{i}" for i in range(4936, 5000)} | {"other"}  # the least headroom
    other_layer = _value(series, "trainvitals_fp8_layer_min_headroom_log2", run="attack", layer="other", role="input")
    assert other_layer == pytest.approx(8.0 - 4935 / 1000)  # the least of the rest
    crests = _label(series, "trainvitals_fp8_worst_crest_log2", "tensor")
    assert crests == {f"blocks.{i}.mlp.fc" for i in range(4990, 5000)}  # the top_k widest of 5,000

    stages = _label(series, "trainvitals_run_stage_step_seconds", "stage")
    assert stages == {str(st) for st in range(936, 1000)} | {"other"}  # registered (< pp) and slowest
    other_stage = _value(series, "trainvitals_run_stage_step_seconds", run="attack", stage="other")
    assert other_stage == pytest.approx(1.0 + 935 / 2 / 1000)  # the median of the rest
    assert _value(series, "trainvitals_run_stages_unregistered", run="attack") == 1_000

    assert sum(per_family.values()) <= PER_RUN_BOUND
    assert sum(per_family.values()) < 200  # was 7,033 before the caps
    assert seconds < SCRAPE_BUDGET_S
    engine.dispose()


def test_open_findings_of_one_run_are_capped_pages_first(db_url: str) -> None:
    """5,000 open findings (a page per clipping tensor would make them): the pages are exported
    first, the rest counted."""
    engine, maker, collector = _collector(db_url)
    with maker() as session:
        batches.register_run(session, RunRegistration(run="noisy"), now=NOW)
        _batch(session, "noisy", 0, [{"kind": "step", "step": 0, "ts": NOW - 1, "step_seconds": 1.0}])
        found = [
            Finding(kind="fp8_jump" if i % 100 else "fp8_clipping", severity="ticket" if i % 100 else "page",
                    run="noisy", subject_kind="tensor", subject=f"blocks.{i}.fc:input", onset_step=0, last_step=0,
                    magnitude=1.0, summary="s", active=True)
            for i in range(5_000)
        ]  # fmt: skip
        findings.store_findings(session, run_id="noisy", findings=found, now=NOW)
    registry = make_registry(collector)
    text, seconds = _scrape(registry)
    print(f"\n[{db_url.split(':')[0]}] 5,000 open findings: scrape {seconds:.3f} s")
    series = _series(text)
    active = series["trainvitals_finding_active"]
    assert len(active) == exposition.OPEN_FINDINGS_PER_RUN
    assert sum(("severity", "page") in labels for labels in active) == 50  # every one of the 50 pages
    assert _value(series, "trainvitals_finding_active_omitted", run="noisy") == 4_950
    assert _value(series, "trainvitals_findings_total", run="noisy", kind="fp8_jump", severity="ticket") == 4_950
    assert seconds < SCRAPE_BUDGET_S
    engine.dispose()


def test_a_thousand_live_runs_export_the_capped_most_severe_and_most_recent(db_url: str) -> None:
    """1,000 live runs in one project (the issue's 13,000 series and 11 s scrape) and 120
    one-run projects: 50 of the sweep (its paging run first, though seen longest ago, then the
    most recent), 100 in all, and the rest counted per project ("" for projects left out)."""
    engine, maker, collector = _collector(db_url)
    sweep = [f"sweep-{i:04d}" for i in range(1_000)]
    singles = [(f"p{i:03d}", f"solo-{i:03d}") for i in range(120)]
    exported = ["sweep-0000", *sweep[-49:], *(run for _p, run in singles[-50:])]
    key = {run: run_keys.run_key(project, run) for project, run in [("sweep", r) for r in sweep] + singles}
    with maker() as session:
        # A registration makes a run live. The runs that will be exported also get steps, reduced,
        # so the timed scrape reads a full snapshot of each; the others cost a scrape only their
        # share of the live-run and severity queries whatever they hold (and building them fast
        # keeps this test short).
        for project, run in [("sweep", r) for r in sweep] + singles:
            batches.register_run(session, RunRegistration(run=run, project=project), now=NOW)
        for run in exported:
            _batch(session, run, 0, [{"kind": "step", "step": s, "ts": NOW - 1, "step_seconds": 1.0} for s in range(2)])
            pipeline.process_run(session, queries.get_run(session, run_id=key[run]), now=NOW)
        page = Finding(kind="run_stalled", severity="page", run=key["sweep-0000"], subject_kind="run", subject="run",
                       onset_step=1, last_step=1, magnitude=60.0, summary="stalled", active=True)  # fmt: skip
        findings.store_findings(session, run_id=key["sweep-0000"], findings=[page], now=NOW)
        # Last seen: the one-run projects longest ago (solo-000 first), then the sweep (sweep-0999
        # the most recent); the ingest path sets it to now, so it is set here, after every write.
        for i, (_project, run) in enumerate(singles + [("sweep", r) for r in sweep]):
            row = session.get(Run, key[run])
            assert row is not None
            row.last_seen_at = NOW - 3_000 + i
        session.commit()
    registry = make_registry(collector)
    text, seconds = _scrape(registry)
    series = _series(text)
    total = sum(len(sets) for sets in series.values())
    print(f"\n[{db_url.split(':')[0]}] 1,120 live runs: {total} series, scrape {seconds:.3f} s")
    runs = _label(series, "trainvitals_run_info", "run")
    assert runs == {key[run] for run in exported}  # a scrape of every project labels by key
    assert len(runs) == exposition.EXPORTED_RUNS
    omitted = {dict(labels)["project"]: n for labels, n in series["trainvitals_runs_omitted"].items()}
    assert omitted == {"sweep": 950, "": 70, **{p: 0 for p, _r in singles[-50:]}}
    per_run = [_of_run(series, run) for run in runs]
    assert max(sum(c.values()) for c in per_run) <= PER_RUN_BOUND
    assert seconds < SCRAPE_BUDGET_S

    # A project's read token scrapes its own runs: the per-project cap, its omitted count.
    scoped = list(collector.collect(project="sweep"))
    info = next(m for m in scoped if m.name == "trainvitals_run_info")
    assert len(info.samples) == exposition.EXPORTED_RUNS_PER_PROJECT
    omitted_family = next(m for m in scoped if m.name == "trainvitals_runs_omitted")
    assert [(s.labels, s.value) for s in omitted_family.samples] == [({"project": "sweep"}, 950)]
    engine.dispose()
