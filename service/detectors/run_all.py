"""Run every detector over one run: the one entry point the collector and the post-mortem call.

Usage::

    findings = detect(series)                       # the run against itself, or its series.baseline
    findings = detect(series, baseline=other_run)   # loss and grad-norm drift against another run
    open_now = [f for f in findings if f.active]    # what the collector exports
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .checkpoints import CheckpointConfig, detect_checkpoints, detect_no_rollback_target
from .findings import Finding
from .fp8 import Fp8Config, detect_fp8
from .grad_norm import GradNormConfig, detect_grad_norm
from .loss import LossConfig, detect_loss
from .mfu import MfuConfig, detect_mfu_gap, detect_mfu_impossible
from .series import RunSeries
from .stragglers import StragglerConfig, detect_stragglers
from .suppression import SuppressionConfig, suppression_for

_SEVERITY_ORDER = {"page": 0, "ticket": 1, "info": 2}


@dataclass(kw_only=True, slots=True, frozen=True)
class DetectorConfig:
    """Every detector threshold, grouped per detector family (each group documents its fields).

    One object so the collector and the post-mortem share exactly the same thresholds; groups so a
    family's thresholds sit next to the code that uses them.
    """

    suppression: SuppressionConfig = field(default_factory=SuppressionConfig)
    """Warm-up, after-resume and phase-change windows."""
    grad_norm: GradNormConfig = field(default_factory=GradNormConfig)
    """Spikes, recurrence, drift, non-finite gradients."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss divergence and non-finite loss."""
    fp8: Fp8Config = field(default_factory=Fp8Config)
    """FP8 headroom, jumps, trend, stale scale, underflow, non-finite, resume step."""
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    """Slow ranks, intermittent slowness, stage imbalance."""
    mfu: MfuConfig = field(default_factory=MfuConfig)
    """MFU gap against the expected MFU."""
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Failed/overdue saves, rollback targets, stalls."""


def detect(
    series: RunSeries,
    *,
    baseline: RunSeries | None = None,
    config: DetectorConfig | None = None,
    data_findings: list[Finding] | None = None,
) -> list[Finding]:
    """All findings of one run, resolved ones included (`active` says which are open), ordered
    page, ticket, info, then by onset step. Pure and deterministic.

    baseline: the run to compare with (detectors/baseline.py); None: the one the series carries
    (`series.baseline`, the run's registered baseline when the collector built it), if any.
    data_findings: `detect_on_data`'s answer for this very series, kept from an earlier call whose
    data was the same; None: computed here."""
    cfg = config or DetectorConfig()
    found = list(detect_on_data(series, baseline=baseline, config=cfg) if data_findings is None else data_findings)
    found += detect_checkpoints(series, cfg.checkpoints)
    found += detect_no_rollback_target(series, cfg.checkpoints, open_pages=found)
    found = [
        dataclasses.replace(f, paged_step=f.detected_step) if f.severity == "page" and f.paged_step is None else f
        for f in found
    ]
    return sorted(found, key=lambda f: (_SEVERITY_ORDER[f.severity], f.onset_step, f.kind, f.subject_kind, f.subject))


def detect_on_data_reads(series: RunSeries, config: DetectorConfig) -> tuple[object, ...]:
    """What `detect_on_data` reads of the series besides its arrays (and the baseline's), for a
    caller that keeps its answer while these and the arrays stay the same: the events (suppression
    windows) and the scalars the registration gives. A data detector that starts reading another
    field of the series adds it here."""
    return (
        series.run, series.events, series.expected_mfu, series.expected_mfu_low, series.mfu_convention,
        series.peak_flops_total, series.fp8_training,
        series.warmup_steps, series.tensors[0].history_len if series.tensors else None, config,
    )  # fmt: skip


def detect_on_data(
    series: RunSeries, *, baseline: RunSeries | None = None, config: DetectorConfig | None = None
) -> list[Finding]:
    """The findings of the detectors that judge the run's data alone: steps, gradient groups, FP8
    tensors, per-rank timing, the baseline, the suppression windows (from the events) and the
    expected MFU; not `series.now` or the checkpoints, which only the checkpoint detectors read.
    The same data gives the same answer, so a caller whose data did not change since its last
    call may keep that answer (the live worker does: at 16,384 ranks these cost 1.5-1.8 s a cycle)."""
    cfg = config or DetectorConfig()
    sup = suppression_for(series, cfg.suppression)
    baseline = baseline if baseline is not None else series.baseline
    found: list[Finding] = []
    found += detect_grad_norm(series, sup, cfg.grad_norm, baseline=baseline)
    found += detect_loss(series, sup, cfg.loss, baseline=baseline)
    found += detect_fp8(series.tensors, series.run, sup, cfg.fp8)
    found += detect_stragglers(series, sup, cfg.stragglers)
    found += detect_mfu_gap(series, sup, cfg.mfu)
    found += detect_mfu_impossible(series, sup, cfg.mfu)
    return found
