"""Detectors: pure functions from a run's step series to findings (no I/O, no clock, no globals).

The collector runs `detect` as data arrives; the post-mortem runs it over a stored run; both get
the same findings because every detector is causal (see `Finding.detected_step`).
"""

from .findings import Finding, Severity, SubjectKind
from .run_all import DetectorConfig, detect
from .series import CheckpointEvent, GroupGradNorms, RankSteps, RunEvent, RunSeries, RunSteps, TensorSeries

__all__ = [
    "CheckpointEvent",
    "DetectorConfig",
    "Finding",
    "GroupGradNorms",
    "RankSteps",
    "RunEvent",
    "RunSeries",
    "RunSteps",
    "Severity",
    "SubjectKind",
    "TensorSeries",
    "detect",
]
