"""serving_gc: the collector's GC settings while it serves, undone when it stops."""

import gc

from trainvitals.service.gc_policy import serving_gc


def test_serving_freezes_the_startup_heap_and_collects_young_objects_less_often_then_restores() -> None:
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with serving_gc():
        assert gc.get_freeze_count() > 0  # what existed at start-up is skipped by full collections
        assert gc.get_threshold() == (10_000, *before[1:])
    assert gc.get_threshold() == before
    assert gc.get_freeze_count() == 0  # an app stopped in a long-lived process (tests) leaves nothing frozen
