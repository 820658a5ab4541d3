"""serving_gc: the collector's GC settings while it serves (and while its analysis child runs), undone
when it stops."""

import gc
import os
import signal
from pathlib import Path

import pytest

from trainvitals.service import cli
from trainvitals.service.analysis.worker import AnalysisWorker
from trainvitals.service.gc_policy import serving_gc


def test_serving_freezes_the_startup_heap_and_collects_young_objects_less_often_then_restores() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with serving_gc():
        assert gc.get_freeze_count() > 0  # what existed at start-up is skipped by full collections
        assert gc.get_threshold() == (10_000, *before[1:])
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0  # an app stopped in a long-lived process (tests) leaves nothing frozen


def test_the_analysis_child_runs_its_worker_with_the_same_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`trainvitals analyse` (serve's analysis child) reads hundreds of thousands of rows a cycle:
    with the default settings a profile of it under ingest load spent 12% of its samples collecting
    garbage. Its worker runs with the serving settings, and they are undone when it stops."""
    seen: list[tuple[int, int]] = []

    def start(self: AnalysisWorker) -> None:  # record the settings the worker runs with, then stop
        seen.append((gc.get_threshold()[0], gc.get_freeze_count()))
        os.kill(os.getpid(), signal.SIGTERM)  # what serve sends its child when it stops

    monkeypatch.setattr(AnalysisWorker, "start", start)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    before = gc.get_threshold()
    try:
        assert cli.main(["analyse", "--db", f"sqlite:///{tmp_path}/tv.db"]) == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert seen and seen[0][0] == 10_000 and seen[0][1] > 0
    assert gc.get_threshold() == before and gc.get_freeze_count() == 0
