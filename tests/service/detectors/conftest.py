"""Builders for small hand-made RunSeries (table tests) shared by the detector tests."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from trainvitals.service.detectors.series import RankSteps, RunEvent, RunSeries, RunSteps, TensorSeries

SeriesBuilder = Callable[..., RunSeries]


def build_series(
    n: int = 3000, *, seed: int = 0, grad_norm: np.ndarray | None = None, loss: np.ndarray | None = None,
    step_seconds: float = 1.0, events: list[RunEvent] | None = None, **kw: object,
) -> RunSeries:
    """A quiet run of n steps: log-normal grad norm (5% noise), slowly decaying loss (1% noise)."""
    rng = np.random.default_rng(seed)
    steps = np.arange(n, dtype=np.int64)
    gn = grad_norm if grad_norm is not None else np.exp(rng.normal(0, 0.05, n))
    lo = loss if loss is not None else (2.0 + 1.0 / np.sqrt(1 + steps / 100)) * np.exp(rng.normal(0, 0.01, n))
    sec = np.full(n, step_seconds)
    return RunSeries(
        run="t",
        steps=RunSteps(steps=steps, loss=lo, grad_norm=gn, grad_nonfinite=np.zeros(n, dtype=np.int64),
                       step_seconds=sec, ts=1e9 + np.cumsum(sec), tokens=np.full(n, 1e6),
                       flops=np.full(n, 4e15)),
        events=events or [],
        **kw,  # type: ignore[arg-type]
    )


def build_tensor(h: np.ndarray, *, lag: np.ndarray | None = None, sat: np.ndarray | None = None,
                 underflow: np.ndarray | None = None, nonfinite: np.ndarray | None = None,
                 crest: np.ndarray | None = None, fmt: str = "e4m3", role: str = "input",
                 shadow: bool = False) -> TensorSeries:
    n = len(h)
    return TensorSeries(
        tensor="layers.3.fc", role=role, format=fmt, steps=np.arange(n, dtype=np.int64), amax=np.ones(n),
        headroom_bits=h, lag_bits=lag if lag is not None else np.zeros(n),
        sat_frac=sat if sat is not None else np.full(n, np.nan),
        underflow_frac=underflow if underflow is not None else np.full(n, np.nan),
        nonfinite=nonfinite if nonfinite is not None else np.zeros(n), crest_bits=crest, shadow=shadow,
    )


def build_ranks(compute: np.ndarray, stages: list[int], *, comm: float = 0.1) -> RankSteps:
    """Synchronous job: every rank's step lasts as long as the slowest rank's compute plus comm."""
    n, r = compute.shape
    job = compute.max(axis=1) + comm
    return RankSteps(
        steps=np.arange(n, dtype=np.int64), ranks=np.arange(r, dtype=np.int64),
        step_seconds=np.repeat(job[:, None], r, axis=1), compute_seconds=compute,
        wait_seconds=job[:, None] - compute, pp_stage=np.asarray(stages, dtype=np.int64),
        node=[f"n{i // 4}" for i in range(r)],
    )


@pytest.fixture
def series() -> SeriesBuilder:
    return build_series


@pytest.fixture
def tensor() -> Callable[..., TensorSeries]:
    return build_tensor


@pytest.fixture
def ranks() -> Callable[..., RankSteps]:
    return build_ranks
