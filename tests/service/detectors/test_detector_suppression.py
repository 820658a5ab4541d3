"""Suppression windows and segments."""

from __future__ import annotations

import numpy as np
import pytest

from trainvitals.service.detectors.series import RunEvent
from trainvitals.service.detectors.suppression import SuppressionConfig, suppression_for


def test_windows_and_segments(series) -> None:
    s = series(5000, events=[
        RunEvent(event="resume", ts=0.0, step=2000),
        RunEvent(event="phase_change", ts=0.0, step=3000, detail="lr anneal"),
        RunEvent(event="note", ts=0.0, step=4000),
        RunEvent(event="failure", ts=0.0, step=None),
    ])
    sup = suppression_for(s, SuppressionConfig(warmup_steps=300, after_resume_steps=100,
                                               after_phase_change_steps=200))
    steps = np.array([0, 299, 300, 1999, 2000, 2099, 2100, 3000, 3199, 3200, 4000])
    quiet = [True, True, False, False, True, True, False, True, True, False, False]
    assert sup.suppressed(steps).tolist() == quiet
    assert sup.segment_ids(steps).tolist() == [0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 2]
    assert sup.resumes == (2000,)


def test_negative_windows_rejected() -> None:
    with pytest.raises(ValueError):
        SuppressionConfig(warmup_steps=-1)


@pytest.mark.parametrize(("own", "end"), [(None, 300), (20, 20), (0, 0)])
def test_a_run_registered_warmup_overrides_the_config(series, own: int | None, end: int) -> None:
    assert suppression_for(series(400, warmup_steps=own), SuppressionConfig(warmup_steps=300)).warmup_end == end
