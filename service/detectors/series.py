"""Detector inputs: per-run series as the collector reduces them from the store (and the
evaluation suite builds them from synthetic runs). Plain numpy arrays indexed by step order.

Everything here is already reduced across ranks except `RankSteps`, which keeps one row per
(step, rank) because straggler detection needs the per-rank view.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(kw_only=True, slots=True)
class RunSteps:
    """Run-level series, one entry per step (ascending, unique)."""

    steps: np.ndarray
    """int64 step numbers."""
    loss: np.ndarray
    """float64 mean loss over ranks (NaN where unknown)."""
    grad_norm: np.ndarray
    """float64 global gradient norm (pre-clip when the job reports it, else the agent's)."""
    grad_nonfinite: np.ndarray
    """int64 count of parameters with non-finite gradients."""
    step_seconds: np.ndarray
    """float64 slowest rank's step time (the job's pace)."""
    ts: np.ndarray
    """float64 Unix seconds at the end of the step (max over ranks)."""
    tokens: np.ndarray
    """float64 tokens processed by the whole job in the step (NaN where unknown)."""
    flops: np.ndarray
    """float64 model FLOPs of the whole job in the step (NaN where unknown)."""
    mfu: np.ndarray | None = None
    """float64 model FLOPs utilisation as the reduction computed and stored it (flops / (step_seconds
    x peak_flops_total)); NaN where unknown, None when the run declares no peak. Detectors read it,
    never recompute it."""
    loss_nonfinite: np.ndarray | None = None
    """int64 ranks that reported a non-finite loss (optional: `loss` is NaN both for 'unknown' and
    for a reported NaN, so this tells them apart; +-inf in `loss` counts without it)."""
    skipped: np.ndarray | None = None
    """bool: the optimizer did not apply the step's update on some rank (a loss scaler such as
    torch.amp.GradScaler skipped it on inf/NaN gradients). None: not known (all applied)."""


@dataclass(kw_only=True, slots=True)
class GroupGradNorms:
    """Per parameter group (layer) gradient norm series."""

    steps: np.ndarray
    groups: list[str]
    norms: np.ndarray
    """float64 [len(steps), len(groups)]."""


@dataclass(kw_only=True, slots=True)
class TensorSeries:
    """One monitored FP8 tensor (module fqn + role), reduced over ranks (amax: max; headroom: min)."""

    tensor: str
    role: str
    format: str
    steps: np.ndarray
    amax: np.ndarray
    headroom_bits: np.ndarray
    lag_bits: np.ndarray
    """NaN where unknown."""
    sat_frac: np.ndarray
    """NaN on steps without expensive-tier stats."""
    underflow_frac: np.ndarray
    nonfinite: np.ndarray
    """float64 counts, NaN where unknown."""
    crest_bits: np.ndarray | None = None
    """log2(amax / median |x|), the worst rank's; NaN on steps without expensive-tier stats. None:
    not measured at all (a series built without it)."""
    shadow: bool = False
    history_len: int | None = None
    """Delayed-scaling amax history length L of the recipe (registration fp8.history_len), optional:
    for the first L steps of the run the history still holds warm-up amaxes, so headroom settles
    for reasons of its own and the trend/stale/underflow baselines ignore those steps."""


@dataclass(kw_only=True, slots=True)
class RankSteps:
    """Per-rank step timing: matrices [len(steps), len(ranks)], NaN where a rank did not report."""

    steps: np.ndarray
    ranks: np.ndarray
    step_seconds: np.ndarray
    compute_seconds: np.ndarray
    wait_seconds: np.ndarray
    pp_stage: np.ndarray
    """int64 per rank (-1 unknown): the cohort key."""
    node: list[str] = field(default_factory=list)
    """hostname per rank when known."""


@dataclass(kw_only=True, slots=True)
class CheckpointEvent:
    generation: int
    step: int
    status: str
    """started | persisted | failed | verified | deleted (its files gone since the save)."""
    ts: float
    stall_seconds: float | None = None
    persist_seconds: float | None = None
    incarnation: int = 0
    """The process that saved it: a restart may save the same generation number again."""


@dataclass(kw_only=True, slots=True)
class RunEvent:
    event: str
    """start, stop, restart, resume, failure, node_replaced, phase_change, rollback, note."""
    ts: float
    step: int | None
    detail: str | None = None
    rank: int | None = None


@dataclass(kw_only=True, slots=True)
class RunSeries:
    """Everything the detectors see of one run."""

    run: str
    steps: RunSteps
    groups: GroupGradNorms | None = None
    tensors: list[TensorSeries] = field(default_factory=list)
    ranks: RankSteps | None = None
    checkpoints: list[CheckpointEvent] = field(default_factory=list)
    events: list[RunEvent] = field(default_factory=list)
    expected_mfu: float | None = None
    """Predicted (advisor) or configured MFU; None: the MFU-gap detector stays silent."""
    expected_mfu_low: float | None = None
    """Low end of the prediction's band (held-out error of its regime, widened outside the calibrated
    domain); the MFU-gap detector's absolute test fires only below it. None: a configured MFU."""
    peak_flops_total: float | None = None
    """Sum over devices of the declared peak FLOP/s, to turn flops/step_seconds into MFU."""
    fp8_training: bool = False
    """The run trains in FP8 (registration fp8.enabled, or tensors read from an FP8 recipe): its
    MFU, against the dense bf16 peak the agent registers, may pass 100% (FP8 doubles the peak)."""
    mfu_convention: str | None = None
    """The FLOP convention the expected and the measured MFU are both counted in (quoted with a gap)."""
    checkpoint_interval_seconds: float | None = None
    """Configured or recommended; None: overdue checks stay silent."""
    now: float | None = None
    """The time the detectors evaluate at (for 'stalled' and 'overdue'); passed in, never read."""
    warmup_steps: int | None = None
    """The run's own warm-up (registration `detector_warmup_steps`), which overrides
    `SuppressionConfig.warmup_steps`; None: the config's."""
    baseline: RunSeries | None = None
    """The run's named baseline run (registration `baseline_run`) over the same steps, which
    `detect()` compares loss and gradient norm with (detectors/baseline.py); None: none named."""
