"""Checkpoint and liveness detectors (wall time comes in as series.now)."""

from __future__ import annotations

from trainvitals.service.detectors.checkpoints import (
    CheckpointConfig,
    detect_failed,
    detect_no_rollback_target,
    detect_overdue,
    detect_stalled,
    rollback_target,
)
from trainvitals.service.detectors.findings import Finding
from trainvitals.service.detectors.series import CheckpointEvent, RunEvent

CFG = CheckpointConfig()
T0 = 1e9  # build_series: step i ends at T0 + i + 1 (1 s steps)


def _ck(gen: int, step: int, *statuses: str) -> list[CheckpointEvent]:
    return [CheckpointEvent(generation=gen, step=step, status=st, ts=T0 + step + 1 + i * 10)
            for i, st in enumerate(statuses)]


def test_failed_save_ticket_then_page_when_repeated(series) -> None:
    s = series(3000, checkpoints=_ck(1, 500, "started", "persisted") + _ck(2, 1000, "started", "failed"))
    (f,) = detect_failed(s, CFG)
    assert (f.kind, f.severity, f.subject_kind, f.subject, f.onset_step, f.active) == (
        "checkpoint_failed", "ticket", "checkpoint", "2", 1000, True)
    s.checkpoints += _ck(3, 1500, "started", "failed")
    by_gen = {f.subject: f for f in detect_failed(s, CFG)}
    assert by_gen["3"].severity == "page" and by_gen["3"].magnitude == 2
    s.checkpoints += _ck(4, 2000, "started", "persisted")
    assert not any(f.active for f in detect_failed(s, CFG))  # a later good save resolves them


def test_overdue_by_unsaved_training_time(series) -> None:
    s = series(3000, checkpoints=_ck(1, 500, "started", "persisted"), checkpoint_interval_seconds=600.0,
               now=T0 + 3001)
    (f,) = detect_overdue(s, CFG)
    # Newest good save at ~T0+511; 1.5 intervals later is step ~1410; 2,490 s unsaved = 4.15 intervals.
    assert f.severity == "page" and 1405 <= f.onset_step <= 1415 and 4.0 < f.magnitude < 4.3
    s.checkpoints += _ck(2, 2500, "started", "persisted")
    assert detect_overdue(s, CFG) == []
    s.checkpoint_interval_seconds = None
    s.checkpoints = []
    assert detect_overdue(s, CFG) == []  # no interval known: silent


def test_stopped_run_is_neither_overdue_nor_stalled(series) -> None:
    s = series(3000, checkpoint_interval_seconds=600.0, now=T0 + 9000,
               events=[RunEvent(event="stop", ts=T0 + 3000, step=2999)])
    assert detect_overdue(s, CFG) == [] and detect_stalled(s, CFG) == []


def test_stalled_after_ten_step_times_with_floor(series) -> None:
    s = series(3000, now=T0 + 3000 + 60)
    assert detect_stalled(s, CFG) == []  # 60 s: under the 120 s floor
    s.now = T0 + 3000 + 600
    (f,) = detect_stalled(s, CFG)
    assert f.kind == "run_stalled" and f.severity == "page" and f.onset_step == 2999 and f.magnitude == 600
    slow = series(3000, step_seconds=100.0)
    slow.now = float(slow.steps.ts[-1]) + 600
    assert detect_stalled(slow, CFG) == []  # 6 steps' time for a 100 s/step run
    s.now = None
    assert detect_stalled(s, CFG) == []


def test_long_checkpoint_stall_is_not_a_stalled_run(series) -> None:
    s = series(3000, now=T0 + 3000 + 300)
    s.checkpoints = [CheckpointEvent(generation=1, step=2500, status="persisted", ts=T0 + 2510,
                                     stall_seconds=200.0)]
    assert detect_stalled(s, CFG) == []


def test_rollback_target_and_no_target(series) -> None:
    s = series(6000, checkpoints=_ck(1, 1000, "started", "persisted", "verified") + _ck(2, 3000, "started"))
    assert rollback_target(s, 5000, CFG).step == 1000
    assert rollback_target(s, 900, CFG) is None
    assert detect_no_rollback_target(s, CFG) == []
    page = Finding(kind="loss_divergence", severity="page", run="t", subject_kind="run", subject="",
                   onset_step=800, last_step=5999, magnitude=2.0, summary="", detected_step=900)
    (f,) = detect_no_rollback_target(s, CFG, open_pages=[page])
    assert f.severity == "page" and f.onset_step == 800
    empty = series(6000)
    (t,) = detect_no_rollback_target(empty, CFG)
    assert t.severity == "ticket" and t.onset_step == 5000
    assert detect_no_rollback_target(series(3000), CFG) == []


def test_a_generation_deleted_since_its_save_is_no_target_and_the_page_says_so(series) -> None:
    """The job's retention removed the saves from before a late divergence: the page that there is
    no rollback target fires, and says they were saved and then deleted, and what keeps them."""
    saves = [_ck(g, g * 1000, "started", "persisted") for g in (1, 2, 3, 4)]
    s = series(5000, checkpoints=[ev for gen in saves for ev in gen])
    page = Finding(kind="loss_divergence", severity="page", run="t", subject_kind="run", subject="",
                   onset_step=2500, last_step=4999, magnitude=2.0, summary="", detected_step=4600)
    assert rollback_target(s, 2500, CFG).step == 2000
    assert detect_no_rollback_target(s, CFG, open_pages=[page]) == []
    s.checkpoints += _ck(1, 1000, "deleted") + _ck(2, 2000, "deleted")  # keep_last=2 after the saves at 3000, 4000
    never_saved_here = CheckpointEvent(generation=9, step=900, status="deleted", ts=T0 + 1, incarnation=7)
    s.checkpoints.append(never_saved_here)  # not counted among the saves deleted since
    assert rollback_target(s, 2500, CFG) is None and rollback_target(s, 5000, CFG).step == 4000
    (f,) = detect_no_rollback_target(s, CFG, open_pages=[page])
    assert f.severity == "page" and f.onset_step == 2500
    assert f.summary.endswith(
        "; the 2 saved before it were deleted since (the job's retention, or a later save to the same path); a "
        "retention of more generations (save_total_limit, save_top_k, keep_last) keeps one from before an onset "
        "until it is paged"
    )


def test_a_generation_saved_again_after_a_restart_is_a_target_though_the_old_save_is_deleted(series) -> None:
    """A relaunch that resumed from generation 1 saved generation 2 again, over the first launch's:
    that one is deleted, the relaunch's is the target (the generation number alone named both)."""
    first = _ck(1, 1000, "started", "persisted") + _ck(2, 2000, "started", "persisted")
    relaunch = _ck(2, 2000, "started", "persisted")
    for ev in relaunch:
        ev.incarnation, ev.ts = 2, ev.ts + 5000
    s = series(3000, checkpoints=first + relaunch + _ck(2, 2000, "deleted"))
    target = rollback_target(s, 2500, CFG)
    assert target is not None and (target.generation, target.incarnation) == (2, 2)
