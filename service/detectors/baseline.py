"""A named baseline run, for the detectors that compare with it (loss divergence, gradient-norm drift).

A baseline is an earlier run of the same recipe (its registration's `baseline_run`, or
`detect(series, baseline=...)`). Compared in log space at equal steps, the shapes both runs share
(warm-up, data order, the end-of-training gradient-norm rise) cancel, and what is left is how this
run differs from the last one.

It serves only while it covers the run's newest step: past the baseline's last step the run is
judged against itself again (one reference per evaluation, never a difference on some steps and a
raw level on others).
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from ._stats import log_positive
from .series import RunSeries


def aligned_log(
    series: RunSeries, baseline: RunSeries | None, column: Literal["loss", "grad_norm"], *, min_steps: int
) -> np.ndarray | None:
    """The baseline's log `column` at the run's steps (NaN where it has no finite value), or None
    when it cannot serve: no baseline, fewer than `min_steps` aligned finite values, or it ends
    before the run's newest step."""
    if baseline is None or not len(baseline.steps.steps) or not len(series.steps.steps):
        return None
    b, steps = baseline.steps, series.steps.steps
    if b.steps[-1] < steps[-1]:
        return None
    rows = np.searchsorted(b.steps, steps)
    ok = rows < len(b.steps)
    ok[ok] = b.steps[rows[ok]] == steps[ok]
    out = np.full(len(steps), np.nan)
    out[ok] = log_positive(getattr(b, column)[rows[ok]])
    return out if np.isfinite(out).sum() >= min_steps else None
