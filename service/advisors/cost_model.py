"""Analytic step-time and MFU model for a parallelism config, calibrated on measured H200 runs.

Collector entry point (the MFU-gap detector calls this at run registration):

    predict_mfu(registration: Mapping[str, Any], *, calibration: Calibration = DEFAULT_CALIBRATION)
        -> MfuPrediction
        registration: a dict with keys "model", "parallelism", "hardware" (wire format v1 run
        registration; unknown keys are ignored). Returns predicted/low/high MFU as fractions of
        n_gpus x peak, plus the FLOP convention. Raises ValueError naming the bad key.

`plan(plan_input)` returns the full report (memory by tenant, step-time breakdown, tokens/s, MFU
band, binding wall).

Model (stragglers_and_mfu.md, "Predicting MFU for a parallelism config"), per optimizer step:
    T_comp = hardware_flops / (n_gpus * peak * eta * (tp_efficiency if tp > 1))
    T_tp   = (L/p) m n_coll 2(t-1)/t (b s h 2 bytes) / BW_tp       n_coll = 4 (6 with full recompute)
    T_pp   = 2 v m b s h 2 bytes / (t BW_inter)
    T_dp   = FSDP: (d-1)/d P_stage (4 m + 4) bytes / BW;  ZeRO<3: 2(d-1)/d P_stage 2 bytes / BW
    T_iter = (T_comp + T_tp + T_pp + T_ep) (1 + (p-1)/(v m)) + dp_exposed * T_dp
    MFU    = tokens * (6 N_active + 12 L h S) / (T_iter * n_gpus * peak)
eta, tp_efficiency and dp_exposed are fitted on seed 002 (`calibrate`, `SEED_002_ROWS`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import least_squares

from trainvitals.service.advisors.memory import MemoryBreakdown, per_gpu_memory
from trainvitals.service.advisors.model_config import PlanInput, parse_plan_input

FLOP_CONVENTION = "6*N_active + 12*L*h*S per token (PaLM app. B; N counts embeddings, recompute excluded)"
CALIBRATED_GPUS = ("H200", "H100-SXM")  # same GH100 compute die and peak: the fit transfers
UNCALIBRATED_BAND = 0.30  # stragglers_and_mfu.md: uncalibrated analytic models miss by 20-30%


@dataclass(kw_only=True, slots=True, frozen=True)
class Calibration:
    """Fitted efficiencies and the prediction band they earned."""

    eta: float
    """Achieved fraction of peak on GEMM-bound compute (no TP)."""
    tp_efficiency: float
    """Multiplier on eta when tp > 1: smaller GEMM shards and un-overlapped TP collectives."""
    dp_exposed: float
    """Fraction of data-parallel/FSDP traffic time not hidden behind compute."""
    band: float
    """Relative half-width of the prediction interval on calibrated GPUs (max leave-one-out error)."""
    mean_abs_error: float
    """In-sample mean |predicted/measured - 1| on the calibration rows."""
    max_abs_error: float
    """In-sample max |predicted/measured - 1|."""
    loo_mean_abs_error: float
    """Leave-one-out mean |predicted/measured - 1|."""
    loo_max_abs_error: float
    """Leave-one-out max |predicted/measured - 1|."""
    source: str
    """Where the rows came from."""


@dataclass(kw_only=True, slots=True, frozen=True)
class CalibrationRow:
    """One measured run: the config and its measured MFU (fraction)."""

    label: str
    """Short name, e.g. "7B FSDP=4"."""
    config: Mapping[str, Any]
    """Plan dict (model/parallelism/hardware)."""
    mfu: float
    """Measured MFU, fraction of n_gpus x peak."""


@dataclass(kw_only=True, slots=True, frozen=True)
class StepTime:
    """Predicted time of one optimizer step, seconds, by component."""

    compute_s: float
    """GEMM-bound compute at the calibrated efficiency."""
    tp_comm_s: float
    """Tensor-parallel collectives (on the critical path)."""
    pp_comm_s: float
    """Pipeline point-to-point sends."""
    ep_comm_s: float
    """Expert-parallel all-to-all (MoE)."""
    dp_comm_exposed_s: float
    """Data-parallel/FSDP traffic not hidden behind compute."""
    dp_comm_total_s: float
    """All data-parallel/FSDP traffic time, hidden or not."""
    bubble_s: float
    """Pipeline bubble."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.tp_comm_s
            + self.pp_comm_s
            + self.ep_comm_s
            + self.bubble_s
            + self.dp_comm_exposed_s
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "compute_s": self.compute_s,
            "tp_comm_s": self.tp_comm_s,
            "pp_comm_s": self.pp_comm_s,
            "ep_comm_s": self.ep_comm_s,
            "dp_comm_exposed_s": self.dp_comm_exposed_s,
            "dp_comm_total_s": self.dp_comm_total_s,
            "bubble_s": self.bubble_s,
            "total_s": self.total_s,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class MfuPrediction:
    """Predicted MFU with its interval."""

    predicted: float
    """Point prediction, fraction."""
    low: float
    """Lower end of the prediction interval."""
    high: float
    """Upper end of the prediction interval."""
    calibrated: bool
    """True when the GPU type is covered by the calibration data."""
    convention: str = FLOP_CONVENTION
    """FLOP counting convention of the number."""

    def as_dict(self) -> dict[str, float | bool | str]:
        return {
            "predicted": self.predicted,
            "low": self.low,
            "high": self.high,
            "calibrated": self.calibrated,
            "convention": self.convention,
        }


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanResult:
    """Everything `trainvitals plan` reports for one config."""

    memory: MemoryBreakdown
    """Per-GPU memory by tenant."""
    step: StepTime
    """Step-time breakdown."""
    tokens_per_s: float
    """Predicted training throughput, tokens/s across the job."""
    mfu: MfuPrediction
    """Predicted MFU band."""
    binding_wall: str
    """The constraint that binds: memory, compute, tp_comm, pp_bubble, dp_comm, ep_comm."""
    model_flops_per_token: float
    """Model FLOPs per token (convention in mfu.convention)."""
    params_total: float
    """Total parameters."""
    params_active: float
    """Parameters touched per token."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """Things the user should know (e.g. does not fit)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "memory": self.memory.as_dict(),
            "step_time": self.step.as_dict(),
            "tokens_per_s": self.tokens_per_s,
            "mfu": self.mfu.as_dict(),
            "binding_wall": self.binding_wall,
            "model_flops_per_token": self.model_flops_per_token,
            "params_total": self.params_total,
            "params_active": self.params_active,
            "warnings": list(self.warnings),
        }


def model_flops_per_token(plan: PlanInput) -> float:
    """6 N_active + 12 L h S (KempnerForge/PaLM; attention counted once, causal mask not halved)."""
    m = plan.model
    return 6 * m.params_active + 12 * m.layers * m.hidden * m.seq_len


def hardware_flops_per_token(plan: PlanInput) -> float:
    """Model FLOPs plus recomputation: full adds one forward (x4/3), selective the attention core."""
    m, mode = plan.model, plan.parallelism.recompute
    base = model_flops_per_token(plan)
    if mode == "full":
        return base * 4 / 3
    if mode == "selective":
        return base + 4 * m.layers * m.hidden * m.seq_len
    return base


def _dp_group_in_node(plan: PlanInput) -> bool:
    # Rank order tp (innermost), cp, dp, pp: the dp group stays in a node when tp*cp*dp fits.
    p = plan.parallelism
    return p.tp * p.cp * p.dp <= plan.hardware.gpus_per_node


def predict_step(plan: PlanInput, calibration: Calibration) -> StepTime:
    """Step-time breakdown for one optimizer step."""
    m, p, hw = plan.model, plan.parallelism, plan.hardware
    intra, inter = hw.gpu.intra_node_gbps * 1e9, hw.gpu.inter_node_gbps * 1e9
    tokens = p.global_batch * m.seq_len
    eta = calibration.eta * (calibration.tp_efficiency if p.tp > 1 else 1.0)
    compute = tokens * hardware_flops_per_token(plan) / (p.gpus * hw.peak_flops * eta)

    mb_act_bytes = p.micro_batch * m.seq_len * m.hidden * 2 / p.cp  # one micro-batch, bf16
    micro = p.micro_batches
    tp_comm = 0.0
    if p.tp > 1:
        n_coll = 6 if p.recompute == "full" else 4
        bw = intra if p.tp <= hw.gpus_per_node else inter
        tp_comm = (m.layers / p.pp) * micro * n_coll * 2 * (p.tp - 1) / p.tp * mb_act_bytes / bw
    pp_comm = 2 * p.vpp * micro * mb_act_bytes / (p.tp * inter) if p.pp > 1 else 0.0
    ep_comm = 0.0
    if p.ep > 1:
        n_a2a = 6 if p.recompute == "full" else 4
        bw = intra if p.ep * p.tp * p.cp <= hw.gpus_per_node else inter
        ep_comm = (
            (m.layers / p.pp)
            * micro
            * n_a2a
            * m.active_experts
            * (p.ep - 1)
            / p.ep
            * mb_act_bytes
            / p.tp
            / bw
        )

    dense = m.params_total - m.expert_params
    stage_params = dense / (p.tp * p.pp) + m.expert_params / (p.tp * p.pp * p.ep)
    d = p.dp * p.cp
    dp_total = 0.0
    if d > 1:
        if p.zero >= 3:  # all-gather (bf16) in forward and backward per micro-batch, one fp32 reduce-scatter
            volume = (d - 1) / d * stage_params * (4 * micro + 4)
        else:  # one bf16 all-reduce (or reduce-scatter + all-gather) of the gradients per step
            volume = 2 * (d - 1) / d * stage_params * 2
        dp_total = volume / (intra if _dp_group_in_node(plan) else inter)

    critical = compute + tp_comm + pp_comm + ep_comm
    bubble = critical * (p.pp - 1) / (p.vpp * micro) if p.pp > 1 else 0.0
    return StepTime(
        compute_s=compute,
        tp_comm_s=tp_comm,
        pp_comm_s=pp_comm,
        ep_comm_s=ep_comm,
        dp_comm_exposed_s=calibration.dp_exposed * dp_total,
        dp_comm_total_s=dp_total,
        bubble_s=bubble,
    )


def _mfu_from_step(plan: PlanInput, step: StepTime) -> float:
    p = plan.parallelism
    tokens = p.global_batch * plan.model.seq_len
    return tokens * model_flops_per_token(plan) / (step.total_s * p.gpus * plan.hardware.peak_flops)


def _binding_wall(plan: PlanInput, memory: MemoryBreakdown, step: StepTime) -> str:
    if not memory.fits:
        return "memory"
    overheads = {
        "tp_comm": step.tp_comm_s,
        "pp_bubble": step.bubble_s + step.pp_comm_s,
        "dp_comm": step.dp_comm_exposed_s,
        "ep_comm": step.ep_comm_s,
    }
    name, worst = max(overheads.items(), key=lambda kv: kv[1])
    if worst > 0.1 * step.total_s:
        return name
    if memory.tenants > 0.9 * (memory.capacity - memory.overhead):
        return "memory"
    return "compute"


def plan(plan_input: PlanInput, calibration: Calibration | None = None) -> PlanResult:
    """Predict memory, step time, throughput and MFU for one config."""
    cal = calibration or DEFAULT_CALIBRATION
    memory = per_gpu_memory(plan_input)
    step = predict_step(plan_input, cal)
    predicted = _mfu_from_step(plan_input, step)
    calibrated = plan_input.hardware.gpu.name in CALIBRATED_GPUS
    band = cal.band if calibrated else UNCALIBRATED_BAND
    mfu = MfuPrediction(
        predicted=predicted, low=predicted * (1 - band), high=predicted * (1 + band), calibrated=calibrated
    )
    warnings: list[str] = []
    if not memory.fits:
        warnings.append(
            f"does not fit: {memory.tenants / 2**30:.1f} GiB of tenants > "
            f"{(memory.capacity - memory.overhead) / 2**30:.1f} GiB usable "
            f"({plan_input.hardware.usable_hbm_fraction:.0%} of HBM)"
        )
    if not calibrated:
        warnings.append(
            f"{plan_input.hardware.gpu.name} is not in the calibration set; band widened "
            f"to +-{UNCALIBRATED_BAND:.0%}"
        )
    p = plan_input.parallelism
    if p.pp > 1 and p.micro_batches < 4 * p.pp:
        warnings.append(
            f"only {p.micro_batches} micro-batches for pp={p.pp}: bubble "
            f"{(p.pp - 1) / (p.micro_batches + p.pp - 1):.0%}; aim for m >= 4*pp"
        )
    tokens = p.global_batch * plan_input.model.seq_len
    return PlanResult(
        memory=memory,
        step=step,
        tokens_per_s=tokens / step.total_s,
        mfu=mfu,
        binding_wall=_binding_wall(plan_input, memory, step),
        model_flops_per_token=model_flops_per_token(plan_input),
        params_total=plan_input.model.params_total,
        params_active=plan_input.model.params_active,
        warnings=tuple(warnings),
    )


def predict_mfu(registration: Mapping[str, Any], *, calibration: Calibration | None = None) -> MfuPrediction:
    """MFU prediction for a run registration dict (keys model/parallelism/hardware)."""
    return plan(parse_plan_input(registration, strict=False), calibration).mfu


# --- calibration on seed 002 -------------------------------------------------------------------


def _kf_row(label: str, model: str, gpus: int, tp: int, mfu_pct: float) -> CalibrationRow:
    # KempnerForge MFU benchmark (2026-04-05): Llama-3 shapes, seq 4096, full AC, FSDP2, 4 H200/node.
    shapes = {
        "7B": {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "ffn_hidden": 14336},
        "13B": {"layers": 40, "hidden": 5120, "heads": 40, "kv_heads": 8, "ffn_hidden": 17920},
        "70B": {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "ffn_hidden": 28672},
    }
    micro, accum = {"7B": (4, 2), "13B": (4, 4), "70B": (2, 4)}[model]
    if model == "7B" and gpus <= 2 and tp == 1:
        micro, accum = 2, 4
    dp = gpus // tp
    config = {
        "model": {**shapes[model], "vocab": 128256, "seq_len": 4096, "gated_mlp": True},
        "parallelism": {
            "gpus": gpus,
            "tp": tp,
            "dp": dp,
            "zero": "fsdp",
            "micro_batch": micro,
            "global_batch": micro * accum * dp,
            "recompute": "full",
        },
        "hardware": {"gpu": "H200", "gpus_per_node": 4},
    }
    return CalibrationRow(label=label, config=config, mfu=mfu_pct / 100)


SEED_002_ROWS: tuple[CalibrationRow, ...] = (
    _kf_row("7B FSDP=4 (4 GPUs)", "7B", 4, 1, 53.8),
    _kf_row("7B TP=4 (4 GPUs)", "7B", 4, 4, 34.7),
    _kf_row("13B FSDP=8 (8 GPUs)", "13B", 8, 1, 44.4),
    _kf_row("13B TP4xFSDP4 (16 GPUs)", "13B", 16, 4, 33.7),
    _kf_row("13B TP4xFSDP8 (32 GPUs)", "13B", 32, 4, 32.7),
    _kf_row("70B TP4xFSDP8 (32 GPUs)", "70B", 32, 4, 25.4),
    _kf_row("7B TP4xFSDP8 (32 GPUs)", "7B", 32, 4, 26.9),
)
"""The seven measured H200 runs quoted in seed 002 (fit set)."""

HELD_OUT_ROWS: tuple[CalibrationRow, ...] = (
    _kf_row("7B 1 GPU", "7B", 1, 1, 57.8),
    _kf_row("7B FSDP=2 (2 GPUs)", "7B", 2, 1, 51.7),
    _kf_row("7B TP=2 (2 GPUs)", "7B", 2, 2, 36.4),
    _kf_row("7B TP2xFSDP2 (4 GPUs)", "7B", 4, 2, 35.9),
    _kf_row("7B TP4xFSDP2 (8 GPUs)", "7B", 8, 4, 30.6),
    _kf_row("13B TP4xFSDP2 (8 GPUs)", "13B", 8, 4, 34.3),
    _kf_row("7B TP4xFSDP4 (16 GPUs)", "7B", 16, 4, 28.6),
)
"""The other seven rows of the same benchmark report, not quoted in seed 002 (validation set)."""


def _predict_rows(params: np.ndarray, plans: Sequence[PlanInput]) -> np.ndarray:
    cal = Calibration(
        eta=float(params[0]),
        tp_efficiency=float(params[1]),
        dp_exposed=float(params[2]),
        band=0.0,
        mean_abs_error=0.0,
        max_abs_error=0.0,
        loo_mean_abs_error=0.0,
        loo_max_abs_error=0.0,
        source="",
    )
    return np.array([_mfu_from_step(pl, predict_step(pl, cal)) for pl in plans])


def _fit(plans: Sequence[PlanInput], measured: np.ndarray) -> np.ndarray:
    # Fit in log space so a 10% miss on a 25% run weighs like a 10% miss on a 55% run.
    result = least_squares(
        lambda x: np.log(_predict_rows(x, plans) / measured),
        x0=np.array([0.6, 0.7, 0.5]),
        bounds=([0.05, 0.05, 0.0], [1.0, 1.0, 1.0]),
    )
    return result.x


def relative_errors(calibration: Calibration, rows: Sequence[CalibrationRow]) -> np.ndarray:
    """predicted/measured - 1 for each row."""
    plans = [parse_plan_input(r.config) for r in rows]
    params = np.array([calibration.eta, calibration.tp_efficiency, calibration.dp_exposed])
    return _predict_rows(params, plans) / np.array([r.mfu for r in rows]) - 1


def calibrate(rows: Sequence[CalibrationRow] = SEED_002_ROWS, *, source: str = "seed 002") -> Calibration:
    """Fit eta, tp_efficiency and dp_exposed on measured rows; band = max leave-one-out error."""
    plans = [parse_plan_input(r.config) for r in rows]
    measured = np.array([r.mfu for r in rows])
    params = _fit(plans, measured)
    in_sample = np.abs(_predict_rows(params, plans) / measured - 1)
    loo = []
    for i in range(len(rows)):
        keep = [j for j in range(len(rows)) if j != i]
        sub = _fit([plans[j] for j in keep], measured[keep])
        loo.append(abs(_predict_rows(sub, [plans[i]])[0] / measured[i] - 1))
    loo_arr = np.array(loo)
    return Calibration(
        eta=float(params[0]),
        tp_efficiency=float(params[1]),
        dp_exposed=float(params[2]),
        band=float(loo_arr.max()),
        mean_abs_error=float(in_sample.mean()),
        max_abs_error=float(in_sample.max()),
        loo_mean_abs_error=float(loo_arr.mean()),
        loo_max_abs_error=float(loo_arr.max()),
        source=source,
    )


DEFAULT_CALIBRATION = Calibration(
    eta=0.7424,
    tp_efficiency=0.6874,
    dp_exposed=0.6446,
    band=0.1175,
    mean_abs_error=0.0500,
    max_abs_error=0.0924,
    loo_mean_abs_error=0.0829,
    loo_max_abs_error=0.1175,
    source="seed 002",
)
"""`calibrate(SEED_002_ROWS)` frozen as constants (a test checks they still match the fit)."""
