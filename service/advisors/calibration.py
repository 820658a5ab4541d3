"""Fit the cost model's few hardware constants on the fit split and measure it on the held-out one.

Fitted: eta per calibrated GPU type, the GEMM half-efficiency width h0, and the DP/ZeRO overlap
share; nothing per point. The band of a regime ("GPU layout", layout = dp, tp, tp+pp or cp) is the
largest held-out error in it.

    python benchmarks/advisor_report.py --cost-model   # prints the tables docs/advisors.md quotes
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import least_squares

from trainvitals.service.advisors.calibration_points import POINTS, SOURCES, CalibrationPoint
from trainvitals.service.advisors.cost_model import (
    Calibration,
    Domain,
    layout_of,
    mfu_from_step,
    predict_step,
    regime_of,
)
from trainvitals.service.advisors.model_config import PlanInput, parse_plan_input

ETA_KEYS = ("A100 megatron", "A100 fsdp", "H100-SXM megatron", "H100-SXM fsdp", "H200 fsdp")
"""The "GPU framework" pairs with their own eta (each has fit points)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class PointError:
    """One point's prediction against its published MFU."""

    point: CalibrationPoint
    predicted: float
    error: float
    """predicted / published - 1."""
    regime: str
    gpus_bucket: str


def _calibration(x: np.ndarray) -> Calibration:
    return Calibration(
        eta=dict(zip(ETA_KEYS, (float(v) for v in x[: len(ETA_KEYS)]), strict=True)),
        tp_efficiency=float(x[-4]),
        gemm_h0=float(x[-3]),
        gemm_m0=float(x[-2]),
        overlap=float(x[-1]),
        regime_error={},
        regime_points={},
        domain={},
        fit_mean_abs_error=0.0,
        heldout_mean_abs_error=0.0,
        heldout_max_abs_error=0.0,
        source="",
    )


def predict_points(calibration: Calibration, plans: Sequence[PlanInput]) -> np.ndarray:
    return np.array([mfu_from_step(pl, predict_step(pl, calibration)) for pl in plans])


def _fit(plans: Sequence[PlanInput], measured: np.ndarray) -> np.ndarray:
    # Log space: a 10% miss on a 25% run weighs like a 10% miss on a 55% run.
    def residuals(x: np.ndarray) -> np.ndarray:
        return np.log(predict_points(_calibration(x), plans) / measured)

    n = len(ETA_KEYS)
    result = least_squares(
        residuals,
        x0=np.array([0.6] * n + [0.8, 200.0, 500.0, 0.5]),
        bounds=([0.1] * n + [0.1, 0.0, 0.0, 0.0], [1.0] * n + [1.0, 4000.0, 20000.0, 1.0]),
    )
    return np.asarray(result.x)


def gpus_bucket(gpus: int) -> str:
    for limit, name in ((8, "1-8"), (64, "9-64"), (512, "65-512"), (4096, "513-4096")):
        if gpus <= limit:
            return name
    return ">4096"


def point_errors(calibration: Calibration, points: Sequence[CalibrationPoint] = POINTS) -> list[PointError]:
    plans = [parse_plan_input(p.config) for p in points]
    predicted = predict_points(calibration, plans)
    return [
        PointError(point=pt, predicted=float(pr), error=float(pr / pt.mfu - 1), regime=regime_of(pl),
                   gpus_bucket=gpus_bucket(pl.parallelism.gpus))
        for pt, pl, pr in zip(points, plans, predicted, strict=True)
    ]


def _domains(points: Sequence[CalibrationPoint]) -> dict[str, Domain]:
    by_gpu: dict[str, list[PlanInput]] = {}
    for pt in points:
        pl = parse_plan_input(pt.config)
        by_gpu.setdefault(pl.hardware.gpu.name, []).append(pl)
    return {
        gpu: Domain(
            gpus=(min(p.parallelism.gpus for p in pls), max(p.parallelism.gpus for p in pls)),
            pp=max(p.parallelism.pp for p in pls),
            cp=max(p.parallelism.cp for p in pls),
            seq_len=max(p.model.seq_len for p in pls),
        )
        for gpu, pls in by_gpu.items()
    }


def calibrate(points: Sequence[CalibrationPoint] = POINTS) -> Calibration:
    """Fit on the points with split "fit", band per regime from those with split "held_out"."""
    fit = [p for p in points if p.split == "fit"]
    held = [p for p in points if p.split == "held_out"]
    plans = [parse_plan_input(p.config) for p in fit]
    x = _fit(plans, np.array([p.mfu for p in fit]))
    # A pair without fit points was not constrained by the fit: leave it out, so its configs borrow
    # a neighbour's eta (Calibration.eta_for) instead of the optimiser's starting value.
    fitted_pairs = {f"{pl.hardware.gpu.name} {pl.parallelism.framework}" for pl in plans}
    # Likewise the DTensor-TP factor needs fsdp runs with tp > 1; without any it stays neutral.
    dtensor_tp = any(pl.parallelism.framework == "fsdp" and pl.parallelism.tp > 1 for pl in plans)
    bare = dataclasses.replace(
        _calibration(x),
        eta={k: v for k, v in _calibration(x).eta.items() if k in fitted_pairs},
        tp_efficiency=float(x[-4]) if dtensor_tp else 1.0,
    )
    fit_err = np.array([abs(e.error) for e in point_errors(bare, fit)])
    held_errors = point_errors(bare, held)
    regime_error: dict[str, float] = {}
    regime_points: dict[str, int] = {}
    for e in held_errors:
        regime_error[e.regime] = max(regime_error.get(e.regime, 0.0), abs(e.error))
        regime_points[e.regime] = regime_points.get(e.regime, 0) + 1
    held_abs = np.array([abs(e.error) for e in held_errors])
    sources = sorted({p.source for p in points})
    return Calibration(
        eta=bare.eta,
        tp_efficiency=bare.tp_efficiency,
        gemm_h0=bare.gemm_h0,
        gemm_m0=bare.gemm_m0,
        overlap=bare.overlap,
        regime_error={k: round(v, 4) for k, v in sorted(regime_error.items())},
        regime_points=dict(sorted(regime_points.items())),
        domain=_domains(points),
        fit_mean_abs_error=float(fit_err.mean()),
        heldout_mean_abs_error=float(held_abs.mean()),
        heldout_max_abs_error=float(held_abs.max()),
        source="; ".join(SOURCES[s] for s in sources),
    )


def leave_one_source_out(points: Sequence[CalibrationPoint] = POINTS) -> list[tuple[str, int, float, float]]:
    """(source, points, mean |error|, max |error|) on each source's points when the constants are
    fitted on the other sources' fit points only: how the model transfers to a source it never saw."""
    rows = []
    for source in sorted({p.source for p in points}):
        others = [p for p in points if p.source != source]
        errors = [abs(e.error) for e in point_errors(calibrate(others), [p for p in points if p.source == source])]
        rows.append((source, len(errors), float(np.mean(errors)), float(np.max(errors))))
    return rows


def relative_errors(calibration: Calibration, points: Sequence[CalibrationPoint]) -> np.ndarray:
    """predicted/published - 1 for each point."""
    return np.array([e.error for e in point_errors(calibration, points)])


def error_table(errors: Sequence[PointError], key: Callable[[PointError], str]) -> list[tuple[str, int, float, float]]:
    """(group, points, mean |error|, max |error|) per group, sorted by group."""
    groups: dict[str, list[float]] = {}
    for e in errors:
        groups.setdefault(key(e), []).append(abs(e.error))
    def order(group: str) -> tuple[float, str]:  # GPU-count buckets in numeric order, others by name
        digits = group.lstrip(">").split("-")[0]
        return (float(digits) + (0.5 if group.startswith(">") else 0) if digits.isdigit() else 0.0, group)

    ordered = sorted(groups.items(), key=lambda kv: order(kv[0]))
    return [(k, len(v), float(np.mean(v)), float(np.max(v))) for k, v in ordered]


REGIME_KEYS: dict[str, Callable[[PointError], str]] = {
    "hardware": lambda e: e.regime.split(" ")[0],
    "layout": lambda e: e.regime.split(" ")[1],
    "gpus": lambda e: e.gpus_bucket,
    "source": lambda e: e.point.source,
    "regime": lambda e: e.regime,
}
"""The groupings the held-out error is reported by."""

__all__ = ["ETA_KEYS", "PointError", "REGIME_KEYS", "calibrate", "error_table", "layout_of",
           "point_errors", "relative_errors"]
