"""Analytic step-time and MFU model for a parallelism config, with a band from held-out error.

Collector entry point (the MFU-gap detector calls this at run registration):

    predict_mfu(registration: Mapping[str, Any], *, calibration: Calibration = DEFAULT_CALIBRATION)
        -> MfuPrediction
        registration: a dict with keys "model", "parallelism", "hardware" (wire format v1 run
        registration; unknown keys are ignored). Returns predicted/low/high MFU as fractions of
        n_gpus x peak, the regime whose held-out error sets the band, and whether the config lies
        outside the calibrated domain. Raises ValueError naming the bad key.

`plan(plan_input)` returns the full report (memory by tenant, step-time breakdown, tokens/s, MFU
band, binding wall, the defaults taken for unstated fields).

Model, per optimizer step on the busiest rank (docs/advisors.md derives each term), m micro-batches
of b sequences per pipeline, v virtual stages, L_s layers on the fullest stage, d = dp*cp:
    T_comp = tokens * hw_flops/token / (n * peak * eta_gpu * w/(w + h0)) * imbalance, w = hidden/tp
    T_tp   = L_s m n_coll 2(t-1)/t (b s h 2 B / cp) / BW_tp                     n_coll 4 (6 full AC)
    T_cp   = L_s m max(0, 3 (c-1) KV_chunk / BW_cp - T_attention)               ring attention
    T_pp   = 2 v m (b s h 2 B / (t cp)) / BW_pp                                 stage sends
    bubble = (T_comp + T_tp + T_cp + T_pp + T_ep) (p-1)/(v m)                  interleaved 1F1B
    T_dp   = traffic(zero) / BW_dp, exposed = max(0, T_dp - overlap * window(zero))
             ZeRO-0: all-reduce 4 B/param/step, window = backward of the last micro-batch
             ZeRO-1: reduce-scatter + all-gather 4 B/param/step, window = one micro-batch
             ZeRO-2: reduce-scatter 2 B/param per micro-batch + all-gather 2 B/param/step
             ZeRO-3/FSDP: all-gather fwd + bwd (bf16) + reduce-scatter (fp32) 8 B/param per
             micro-batch, window = all compute; with pp > 1 the stage stays gathered across the
             micro-batches: 6 B/param per step, window = one micro-batch
    MFU    = tokens * (6 N_active + 12 L h S) / (T_iter * n * peak)
eta_gpu (per GPU type), h0 and overlap are fitted (`calibration.calibrate`) on the fit split of
`calibration_points.POINTS`; bandwidths are nominal times the fixed effective shares below.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainvitals.service.advisors.memory import MemoryBreakdown, per_gpu_memory
from trainvitals.service.advisors.model_config import PlanInput, parse_plan_input

FLOP_CONVENTION = (
    "6*N_active + 12*L*h*S per token (PaLM app. B; h = heads x head_dim; N counts embeddings, recompute excluded)"
)
UNCALIBRATED_BAND = 0.30  # stragglers_and_mfu.md: uncalibrated analytic models miss by 20-30%
BAND_FLOOR = 0.10  # a handful of held-out points per regime cannot vouch for less
MIN_REGIME_POINTS = 3  # a thinner regime also takes the worst held-out error of its GPU type
BAND_CAP = 0.60
WIDEN_PER_DOUBLING = 0.05  # outside the calibrated domain: +5 points of band per doubling beyond it
NVLINK_EFFECTIVE = 0.4  # nccl-tests all-reduce bus bandwidth / marketed NVLink (~360 of "900" GB/s)
NETWORK_EFFECTIVE = 0.8  # bus bandwidth / NIC line rate on InfiniBand/RoCE (~40 of 50 GB/s)
NEAREST_CALIBRATED = {"H100-PCIe": "H100-SXM", "B200": "H200", "GB200": "H200", "custom": "H100-SXM"}
"""GPU types without calibration points borrow the efficiency of this one (and a wider band)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Domain:
    """The span of the calibration points of one GPU type."""

    gpus: tuple[int, int]
    """Smallest and largest GPU count."""
    pp: int
    """Deepest pipeline."""
    cp: int
    """Largest context-parallel degree."""
    seq_len: int
    """Longest sequence."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Calibration:
    """Fitted efficiencies, the held-out error by regime (the band), and the calibrated domain."""

    eta: Mapping[str, float]
    """Achieved fraction of peak on large GEMMs, per calibrated "GPU framework" pair."""
    tp_efficiency: float
    """Multiplier on eta with tp > 1 under the fsdp framework (DTensor TP: unfused, un-overlapped
    collectives; Megatron's TP cost is the bandwidth term alone)."""
    gemm_h0: float
    """GEMM width at which efficiency halves: eta * w/(w + h0), w = hidden/tp per GPU."""
    gemm_m0: float = 0.0
    """Micro-batch tokens per GPU at which efficiency halves: x M/(M + m0), M = b s / cp."""
    overlap: float
    """Share of the available compute window that hides data-parallel/ZeRO traffic."""
    regime_error: Mapping[str, float]
    """Max |predicted/published - 1| over the held-out points of each regime ("GPU layout")."""
    regime_points: Mapping[str, int]
    """Held-out points per regime."""
    domain: Mapping[str, Domain]
    """Per calibrated GPU type, the span of its calibration points."""
    fit_mean_abs_error: float
    """Mean |predicted/published - 1| on the fit points."""
    heldout_mean_abs_error: float
    """Mean |predicted/published - 1| on the held-out points."""
    heldout_max_abs_error: float
    """Max |predicted/published - 1| on the held-out points."""
    source: str
    """Where the points came from."""

    def eta_for(self, gpu: str, framework: str) -> float:
        """The pair's eta; else the same GPU under the other framework; else the nearest GPU's."""
        near = NEAREST_CALIBRATED.get(gpu, "H100-SXM")
        for key in (f"{gpu} {framework}", *(k for k in self.eta if k.split(" ")[0] == gpu),
                    f"{near} {framework}", *(k for k in self.eta if k.split(" ")[0] == near)):
            if key in self.eta:
                return self.eta[key]
        return 0.5


@dataclass(kw_only=True, slots=True, frozen=True)
class StepTime:
    """Predicted time of one optimizer step, seconds, by component."""

    compute_s: float
    """GEMM-bound compute at the calibrated efficiency (fullest pipeline stage)."""
    tp_comm_s: float
    """Tensor-parallel collectives (on the critical path)."""
    pp_comm_s: float
    """Pipeline point-to-point sends."""
    ep_comm_s: float
    """Expert-parallel all-to-all (MoE)."""
    dp_comm_exposed_s: float
    """Data-parallel/ZeRO traffic not hidden behind compute."""
    dp_comm_total_s: float
    """All data-parallel/ZeRO traffic time, hidden or not."""
    bubble_s: float
    """Pipeline bubble."""
    cp_comm_s: float = 0.0
    """Ring-attention KV exchange not hidden behind attention compute."""

    @property
    def total_s(self) -> float:
        return (
            self.compute_s
            + self.tp_comm_s
            + self.cp_comm_s
            + self.pp_comm_s
            + self.ep_comm_s
            + self.bubble_s
            + self.dp_comm_exposed_s
        )

    def as_dict(self) -> dict[str, float]:
        return {
            "compute_s": self.compute_s,
            "tp_comm_s": self.tp_comm_s,
            "cp_comm_s": self.cp_comm_s,
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
    """True when the GPU type has calibration points."""
    convention: str = FLOP_CONVENTION
    """FLOP counting convention of the number."""
    band: float = UNCALIBRATED_BAND
    """Relative half-width: held-out error of the regime, widened outside the calibrated domain."""
    regime: str = ""
    """The regime whose held-out error set the band ("H100-SXM tp+pp", ...)."""
    outside: tuple[str, ...] = ()
    """Why the config is outside the calibrated domain (empty: inside)."""

    @property
    def in_domain(self) -> bool:
        return self.calibrated and not self.outside

    def as_dict(self) -> dict[str, Any]:
        return {
            "predicted": self.predicted,
            "low": self.low,
            "high": self.high,
            "calibrated": self.calibrated,
            "convention": self.convention,
            "band": self.band,
            "regime": self.regime,
            "in_domain": self.in_domain,
            "outside": list(self.outside),
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
    """The constraint that binds: memory, compute, tp_comm, cp_comm, pp_bubble, dp_comm, ep_comm."""
    model_flops_per_token: float
    """Model FLOPs per token (convention in mfu.convention)."""
    params_total: float
    """Total parameters."""
    params_active: float
    """Parameters touched per token."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """Things the user should know (e.g. does not fit)."""
    defaults: tuple[str, ...] = field(default_factory=tuple)
    """Unstated fields and the value assumed for each."""

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
            "defaults": list(self.defaults),
        }


def model_flops_per_token(plan: PlanInput) -> float:
    """6 N_active + 12 L h S (KempnerForge/PaLM; attention counted once, causal mask not halved), h the
    attention width heads x head_dim (= hidden unless the model's head_dim says otherwise)."""
    m = plan.model
    return 6 * m.params_active + 12 * m.layers * m.attention_width * m.seq_len


def hardware_flops_per_token(plan: PlanInput) -> float:
    """Model FLOPs plus recomputation: full adds one forward (x4/3), selective the attention core."""
    m, mode = plan.model, plan.parallelism.recompute
    base = model_flops_per_token(plan)
    if mode == "full":
        return base * 4 / 3
    if mode == "selective":
        return base + 4 * m.layers * m.attention_width * m.seq_len
    return base


def _bandwidths(plan: PlanInput) -> tuple[float, float]:
    gpu = plan.hardware.gpu
    return gpu.intra_node_gbps * 1e9 * NVLINK_EFFECTIVE, gpu.inter_node_gbps * 1e9 * NETWORK_EFFECTIVE


def group_bandwidth(plan: PlanInput, *, stride: int, size: int) -> float:
    """Per-rank bus bandwidth of a collective over `size` ranks spaced `stride` apart.

    Rank order tp (innermost), cp, dp, pp. Inside a node: NVLink. Across nodes NCCL runs one ring
    per NIC with NVLink inside each node, so the k members of the group that share a node share k
    NICs: min(NVLink, k x NIC)."""
    intra, inter = _bandwidths(plan)
    node = plan.hardware.gpus_per_node
    if stride * size <= node:
        return intra
    members_per_node = max(1, min(size, node // stride))
    return min(intra, members_per_node * inter)


def _dp_traffic(plan: PlanInput, t_mb: float, bw: float, overlap: float) -> tuple[float, float]:
    """(total, exposed) seconds of data-parallel/ZeRO traffic per step for one rank."""
    p = plan.parallelism
    d = p.dp * p.cp
    if d == 1:
        return 0.0, 0.0
    params = plan.stage_params
    ring = (d - 1) / d
    micro = p.micro_batches
    if p.zero == 0:  # one bf16 all-reduce, hidden behind the last micro-batch's backward
        volume, window = 2 * ring * params * 2, t_mb * 2 / 3
    elif p.zero == 1:  # reduce-scatter grads (last backward) + all-gather params (first forward)
        volume, window = ring * params * 4, t_mb
    elif p.zero == 2:  # reduce-scatter per micro-batch backward + one all-gather per step
        volume, window = ring * params * (2 * micro + 2), t_mb * (2 / 3 * micro + 1 / 3)
    elif p.pp > 1:  # FSDP under PP keeps the stage gathered across micro-batches (torchtitan, Llama 3)
        volume, window = ring * params * (2 + 4), t_mb
    else:  # FSDP: gather for forward and backward, fp32 reduce-scatter, every micro-batch
        volume, window = ring * params * 8 * micro, t_mb * micro
    total = volume / bw
    exposed = max(0.0, total - overlap * window) if p.overlap_dp_comm else total
    return total, exposed


def predict_step(plan: PlanInput, calibration: Calibration) -> StepTime:
    """Step-time breakdown for one optimizer step on the busiest rank."""
    m, p, hw = plan.model, plan.parallelism, plan.hardware
    tokens = p.global_batch * m.seq_len
    width = m.hidden / p.tp
    rows = p.micro_batch * m.seq_len / p.cp
    eta = (
        calibration.eta_for(hw.gpu.name, p.framework)
        * width / (width + calibration.gemm_h0)
        * rows / (rows + calibration.gemm_m0)
    )
    if p.tp > 1 and p.framework == "fsdp":
        eta *= calibration.tp_efficiency
    rate = hw.peak_flops * eta
    imbalance = plan.stage_layers / (m.layers / p.pp)
    compute = tokens * hardware_flops_per_token(plan) / (p.gpus * rate) * imbalance
    micro = p.micro_batches
    t_mb = compute / micro
    layers = plan.stage_layers

    act_bytes = p.micro_batch * m.seq_len * m.hidden * 2 / p.cp  # one micro-batch's activations, bf16
    tp_comm = 0.0
    if p.tp > 1:
        n_coll = 6 if p.recompute == "full" else 4
        bw = group_bandwidth(plan, stride=1, size=p.tp)
        tp_comm = layers * micro * n_coll * 2 * (p.tp - 1) / p.tp * act_bytes / bw

    cp_comm = 0.0
    if p.cp > 1:
        # Ring attention: c-1 KV chunks pass each rank in forward, KV and dKV in backward (3x),
        # overlapped with the attention core of the local chunk.
        kv_dim = m.kv_heads * m.head_dim / min(p.tp, m.kv_heads)
        chunk = 2 * p.micro_batch * (m.seq_len / p.cp) * kv_dim * 2
        bw = group_bandwidth(plan, stride=p.tp, size=p.cp)
        ring = 3 * (p.cp - 1) * chunk / bw
        attention = p.micro_batch * (m.seq_len / p.cp) * 12 * m.attention_width * m.seq_len / p.tp / rate
        cp_comm = layers * micro * max(0.0, ring - attention)

    pp_comm = 0.0
    if p.pp > 1:
        bw = group_bandwidth(plan, stride=p.tp * p.cp * p.dp, size=2)  # a stage and the next
        sent = act_bytes / (p.tp if p.sequence_parallel else 1)
        pp_comm = 2 * p.vpp * micro * sent / bw

    ep_comm = 0.0
    if p.ep > 1:
        n_a2a = 6 if p.recompute == "full" else 4
        bw = group_bandwidth(plan, stride=p.tp * p.cp, size=p.ep)
        ep_comm = layers * micro * n_a2a * m.active_experts * (p.ep - 1) / p.ep * act_bytes / p.tp / bw

    dp_bw = group_bandwidth(plan, stride=p.tp, size=p.cp * p.dp)
    dp_total, dp_exposed = _dp_traffic(plan, t_mb, dp_bw, calibration.overlap)

    critical = compute + tp_comm + cp_comm + pp_comm + ep_comm
    bubble = critical * (p.pp - 1) / (p.vpp * micro) if p.pp > 1 else 0.0
    return StepTime(
        compute_s=compute,
        tp_comm_s=tp_comm,
        cp_comm_s=cp_comm,
        pp_comm_s=pp_comm,
        ep_comm_s=ep_comm,
        dp_comm_exposed_s=dp_exposed,
        dp_comm_total_s=dp_total,
        bubble_s=bubble,
    )


def mfu_from_step(plan: PlanInput, step: StepTime) -> float:
    p = plan.parallelism
    tokens = p.global_batch * plan.model.seq_len
    return tokens * model_flops_per_token(plan) / (step.total_s * p.gpus * plan.hardware.peak_flops)


def layout_of(plan: PlanInput) -> str:
    """The layout class of a config: dp, tp, tp+pp or cp (the regimes errors are reported by)."""
    p = plan.parallelism
    if p.cp > 1:
        return "cp"
    if p.pp > 1:
        return "tp+pp"
    return "tp" if p.tp > 1 else "dp"


def regime_of(plan: PlanInput) -> str:
    return f"{plan.hardware.gpu.name} {layout_of(plan)}"


def _doublings(value: float, limit: float) -> float:
    return math.log2(value / limit) if value > limit else 0.0


def band_for(plan: PlanInput, calibration: Calibration) -> tuple[float, str, tuple[str, ...], bool]:
    """(band, regime, reasons outside the domain, calibrated) for a config."""
    gpu = plan.hardware.gpu.name
    p, m = plan.parallelism, plan.model
    regime = regime_of(plan)
    domain = calibration.domain.get(gpu)
    if domain is None:
        near = NEAREST_CALIBRATED.get(gpu, "H100-SXM")
        return UNCALIBRATED_BAND, regime, (f"{gpu} has no calibration points (efficiency borrowed from {near})",), False
    errors = calibration.regime_error
    worst_of_gpu = max((v for k, v in errors.items() if k.split(" ")[0] == gpu), default=UNCALIBRATED_BAND)
    if regime not in errors:  # nearest regime: the worst one of the same GPU type
        base = worst_of_gpu
        regime = f"{gpu} (no held-out {layout_of(plan)} points: worst {gpu} regime)"
    elif calibration.regime_points.get(regime, 0) < MIN_REGIME_POINTS:
        base = max(errors[regime], worst_of_gpu)
        regime = f"{regime} ({calibration.regime_points.get(regime, 0)} held-out points: with the worst {gpu} regime)"
    else:
        base = errors[regime]
    band = max(base, BAND_FLOOR)
    reasons: list[str] = []
    if f"{gpu} {p.framework}" not in calibration.eta:
        # Borrowing another stack's efficiency misses by 19-30% (leave-one-source-out, docs/advisors.md).
        reasons.append(f"no {gpu} {p.framework} calibration points (efficiency borrowed from "
                       f"{gpu} {'fsdp' if p.framework == 'megatron' else 'megatron'} or a neighbour)")
        band = max(band, UNCALIBRATED_BAND)
    widen = 0.0
    for name, value, limit in (
        ("gpus", p.gpus, domain.gpus[1]),
        ("pp", p.pp, domain.pp),
        ("cp", p.cp, domain.cp),
        ("seq_len", m.seq_len, domain.seq_len),
    ):
        if value > limit:
            reasons.append(f"{name}={value} > {limit}, the largest calibrated on {gpu}")
            widen += _doublings(value, limit)
    if p.gpus < domain.gpus[0]:
        reasons.append(f"gpus={p.gpus} < {domain.gpus[0]}, the smallest calibrated on {gpu}")
        widen += _doublings(domain.gpus[0], p.gpus)
    if plan.hardware.precision != "bf16":
        reasons.append(f"precision {plan.hardware.precision}: calibrated on bf16 runs only")
        widen += 1.0
    band = min(BAND_CAP, band + WIDEN_PER_DOUBLING * widen)
    return band, regime, tuple(reasons), True


def _binding_wall(memory: MemoryBreakdown, step: StepTime) -> str:
    if not memory.fits:
        return "memory"
    overheads = {
        "tp_comm": step.tp_comm_s,
        "cp_comm": step.cp_comm_s,
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


def predict_mfu_band(plan_input: PlanInput, step: StepTime, calibration: Calibration) -> MfuPrediction:
    predicted = mfu_from_step(plan_input, step)
    band, regime, outside, calibrated = band_for(plan_input, calibration)
    return MfuPrediction(
        predicted=predicted,
        low=predicted * (1 - band),
        high=predicted * (1 + band),
        calibrated=calibrated,
        band=band,
        regime=regime,
        outside=outside,
    )


def plan(plan_input: PlanInput, calibration: Calibration | None = None) -> PlanResult:
    """Predict memory, step time, throughput and MFU for one config."""
    cal = calibration or DEFAULT_CALIBRATION
    memory = per_gpu_memory(plan_input)
    step = predict_step(plan_input, cal)
    mfu = predict_mfu_band(plan_input, step, cal)
    warnings: list[str] = []
    if not memory.fits:
        warnings.append(
            f"does not fit: {memory.tenants / 2**30:.1f} GiB of tenants > "
            f"{(memory.capacity - memory.overhead) / 2**30:.1f} GiB usable "
            f"({plan_input.hardware.usable_hbm_fraction:.0%} of HBM)"
        )
    if mfu.outside:
        warnings.append(
            "outside the calibrated domain (" + "; ".join(mfu.outside) + f"): band widened to +-{mfu.band:.0%}"
        )
    p = plan_input.parallelism
    if p.pp > 1 and p.micro_batches < 4 * p.pp:
        bubble = (p.pp - 1) / (p.vpp * p.micro_batches + p.pp - 1)
        warnings.append(
            f"only {p.micro_batches} micro-batches for pp={p.pp} (vpp={p.vpp}): bubble {bubble:.0%}; "
            "aim for m >= 4*pp or interleave"
        )
    if p.uneven_stages and plan_input.model.layers % p.pp:
        warnings.append(
            f"uneven stages: {plan_input.stage_layers:.0f} layers on the fullest of {p.pp} stages "
            f"({plan_input.model.layers / p.pp:.2f} on average) set the pace"
        )
    tokens = p.global_batch * plan_input.model.seq_len
    return PlanResult(
        memory=memory,
        step=step,
        tokens_per_s=tokens / step.total_s,
        mfu=mfu,
        binding_wall=_binding_wall(memory, step),
        model_flops_per_token=model_flops_per_token(plan_input),
        params_total=plan_input.model.params_total,
        params_active=plan_input.model.params_active,
        warnings=tuple(warnings),
        defaults=plan_input.defaults,
    )


def predict_mfu(registration: Mapping[str, Any], *, calibration: Calibration | None = None) -> MfuPrediction:
    """MFU prediction for a run registration dict (keys model/parallelism/hardware)."""
    return plan(parse_plan_input(registration, strict=False), calibration).mfu


DEFAULT_CALIBRATION = Calibration(
    eta={
        "A100 megatron": 0.88,
        "A100 fsdp": 0.7161,
        "H100-SXM megatron": 0.7416,
        "H100-SXM fsdp": 0.5085,
        "H200 fsdp": 0.7261,
    },
    tp_efficiency=0.9491,
    gemm_h0=418.4,
    gemm_m0=335.8,
    overlap=0.8432,
    regime_error={
        "A100 dp": 0.1454,
        "A100 tp": 0.1122,
        "A100 tp+pp": 0.1054,
        "H100-SXM cp": 0.0204,
        "H100-SXM dp": 0.1891,
        "H100-SXM tp+pp": 0.0645,
        "H200 dp": 0.1788,
        "H200 tp": 0.0985,
    },
    regime_points={
        "A100 dp": 6,
        "A100 tp": 2,
        "A100 tp+pp": 4,
        "H100-SXM cp": 1,
        "H100-SXM dp": 7,
        "H100-SXM tp+pp": 1,
        "H200 dp": 2,
        "H200 tp": 5,
    },
    domain={
        "H200": Domain(gpus=(1, 32), pp=1, cp=1, seq_len=4096),
        "H100-SXM": Domain(gpus=(8, 16384), pp=16, cp=16, seq_len=131072),
        "A100": Domain(gpus=(8, 512), pp=64, cp=1, seq_len=32768),
    },
    fit_mean_abs_error=0.06651,
    heldout_mean_abs_error=0.08764,
    heldout_max_abs_error=0.1891,
    source="calibration_points.POINTS: KempnerForge (seed 002), llm-foundry, Korthikanti et al. 2022, Llama 3",
)
"""`calibration.calibrate()` frozen as constants (a test checks they still match the fit)."""
