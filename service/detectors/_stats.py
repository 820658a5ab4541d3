"""Causal robust statistics shared by the detectors (private).

Every helper looks only backwards: the value at index i uses entries before i (or up to and
including i where the name says so). That is what makes a detector give the same answer live, as
steps arrive, and offline over a stored run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

MAD_TO_SIGMA = 1.4826
"""1 / Phi^-1(3/4): MAD of a normal sample times this estimates its standard deviation."""


def log_positive(values: np.ndarray) -> np.ndarray:
    """Natural log, NaN where the value is not finite and positive (losses and norms are
    multiplicative: the detectors work in log space)."""
    ok = np.isfinite(values) & (values > 0)
    return np.log(np.where(ok, values, 1.0)) + np.where(ok, 0.0, np.nan)


def _window_rows(x: np.ndarray, window: int, ends: np.ndarray) -> np.ndarray:
    """Row k holds x[ends[k] - window : ends[k]] (NaN where that reaches before the start)."""
    idx = ends[:, None] - window + np.arange(window)[None, :]
    rows = np.where(idx >= 0, x[np.clip(idx, 0, max(len(x) - 1, 0))], np.nan)
    return rows.astype(float)


def _row_quantile(sorted_rows: np.ndarray, count: np.ndarray, q: float) -> np.ndarray:
    """q-quantile of each row's first `count` entries (rows sorted ascending, NaN last)."""
    pos = q * np.maximum(count - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.ceil(pos).astype(np.int64)
    a = np.take_along_axis(sorted_rows, lo[:, None], axis=1)[:, 0]
    b = np.take_along_axis(sorted_rows, hi[:, None], axis=1)[:, 0]
    out = a + (b - a) * (pos - lo)
    out[count == 0] = np.nan
    return out


def _strided_ends(n: int, stride: int) -> tuple[np.ndarray, np.ndarray]:
    """Window ends (exclusive) evaluated every `stride` steps, and the end each index uses.

    Index i uses the window ending at floor(i / stride) * stride <= i: strictly past data, refreshed
    every `stride` steps. A baseline of hundreds of steps barely moves in a few steps, and this cuts
    the cost by `stride`.
    """
    ends = np.arange(0, n, stride, dtype=np.int64)
    return ends, np.arange(n, dtype=np.int64) // stride


def trailing_median(
    x: np.ndarray, window: int, *, min_count: int, include_current: bool = False, stride: int = 1
) -> np.ndarray:
    """Median of the `window` finite entries before each index (through it with include_current);
    NaN where fewer than `min_count`."""
    n = len(x)
    if n == 0:
        return np.empty(0)
    if include_current:
        ends, use = np.arange(1, n + 1, dtype=np.int64), np.arange(n)
    else:
        ends, use = _strided_ends(n, stride)
    rows = np.sort(_window_rows(np.asarray(x, dtype=float), window, ends), axis=1)
    count = np.isfinite(rows).sum(axis=1)
    med = _row_quantile(rows, count, 0.5)
    med[count < min_count] = np.nan
    return med[use]


def trailing_median_scale(
    x: np.ndarray, window: int, *, min_count: int, stride: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(median, 1.4826 * MAD) of the `window` entries before each index; NaN without enough history.

    The median and MAD tolerate up to half the window being outliers, so isolated spikes need not be
    removed from the baseline first. Refreshed every `stride` steps (default window / 20).
    """
    n = len(x)
    if n == 0:
        return np.empty(0), np.empty(0)
    ends, use = _strided_ends(n, stride or max(window // 20, 1))
    rows = np.sort(_window_rows(np.asarray(x, dtype=float), window, ends), axis=1)
    count = np.isfinite(rows).sum(axis=1)
    med = _row_quantile(rows, count, 0.5)
    dev = np.sort(np.abs(rows - med[:, None]), axis=1)
    scale = MAD_TO_SIGMA * _row_quantile(dev, count, 0.5)
    thin = count < min_count
    med[thin] = np.nan
    scale[thin] = np.nan
    return med[use], scale[use]


def segment_apply(
    segments: np.ndarray, fn: Callable[..., tuple[np.ndarray, ...]], *arrays: np.ndarray
) -> tuple[np.ndarray, ...]:
    """Run `fn(*slices) -> tuple of arrays` on each run of equal segment ids and stitch the results.

    Baselines restart at each segment boundary (resume, rollback, phase change), so history from
    before the boundary never leaks into the statistics after it.
    """
    n = len(segments)
    if n == 0:
        return fn(*arrays)
    cuts = np.flatnonzero(np.diff(segments)) + 1
    bounds = np.concatenate([[0], cuts, [n]])
    parts: list[tuple[np.ndarray, ...]] = []
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        parts.append(fn(*(arr[a:b] for arr in arrays)))
    return tuple(np.concatenate([p[k] for p in parts]) for k in range(len(parts[0])))


def runs_of_true(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) index pairs of consecutive True entries."""
    if len(mask) == 0:
        return []
    m = np.concatenate([[False], mask.astype(bool), [False]])
    d = np.diff(m.astype(np.int8))
    starts = np.flatnonzero(d == 1)
    ends = np.flatnonzero(d == -1)
    return list(zip(starts.tolist(), ends.tolist(), strict=True))


def trailing_count(positions: np.ndarray, events: np.ndarray, window: float) -> np.ndarray:
    """For each position p: how many event positions e satisfy p - window < e <= p (both sorted)."""
    hi = np.searchsorted(events, positions, side="right")
    lo = np.searchsorted(events, positions - window, side="right")
    return hi - lo


def fmt_int(n: float) -> str:
    return f"{int(round(n)):,}"


def nanmedian(a: np.ndarray, axis: int) -> np.ndarray:
    """Median along `axis` ignoring NaN (NaN where all are NaN), without numpy's slow masked path."""
    moved = np.moveaxis(np.asarray(a, dtype=float), axis, -1)
    shape = moved.shape[:-1]
    flat = np.sort(moved.reshape(-1, moved.shape[-1]), axis=1)
    count = np.isfinite(flat).sum(axis=1)
    return _row_quantile(flat, count, 0.5).reshape(shape)
