"""Recommend a parallelism layout by climbing the ladder of seed 000.

At each rung: compute the bill, find the wall that binds, add the cheapest axis that relieves it,
re-check. Order (seeds 000, 002, 003): plain data parallelism with ZeRO-1 while the replicated
state fits one GPU; FSDP (ZeRO-3) across all GPUs; TP inside the node (up to the node size);
EP for sparse (MoE) models; PP across nodes when TP alone cannot hold the weights (trying ZeRO-1
before ZeRO-3 there, seed 004 section 4); data parallelism takes whatever GPUs remain. Memory is
checked against the usable share of HBM (75% by default, seed 001).

    >>> from trainvitals.service.advisors.model_config import parse_model, parse_hardware
    >>> cfg = {"model": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096,
    ...                  "params": 7e9}, "hardware": {"gpu": "H100-SXM"}}
    >>> rec = recommend(model=parse_model(cfg), hardware=parse_hardware(cfg), gpus=8)
    >>> (rec.config.tp, rec.config.pp, rec.config.dp, rec.steps[0].wall)
    (1, 1, 8, 'state > 1 GPU')
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from trainvitals.service.advisors.cost_model import Calibration, PlanResult, plan
from trainvitals.service.advisors.memory import BYTES_GRAD, BYTES_OPTIM, BYTES_PARAM, per_gpu_memory
from trainvitals.service.advisors.model_config import (
    HardwareConfig,
    ModelConfig,
    ParallelismConfig,
    PlanInput,
    parse_hardware,
    parse_model,
)

STATIC_BYTES_PER_PARAM = BYTES_PARAM + BYTES_GRAD + BYTES_OPTIM  # 16 for bf16 + AdamW
DEFAULT_CRITICAL_BATCH_TOKENS = 2 * 1024 * 1024  # seed 000: "a 2M-token critical batch"


@dataclass(kw_only=True, slots=True, frozen=True)
class LadderStep:
    """One rung: the wall found and the axis added to relieve it."""

    wall: str
    """The binding wall, in seed 000's words ("state > 1 GPU", "weights/GPU", ...)."""
    axis: str
    """The axis added ("FSDP/ZeRO-3", "TP", "+ EP (MoE)", "+ PP", or "(forces multi-node)")."""
    detail: str
    """The numbers that forced it."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Recommendation:
    """The chosen layout, or why none fits."""

    feasible: bool
    """True when a layout fits on the given GPUs."""
    config: ParallelismConfig | None
    """The chosen layout (None when infeasible)."""
    result: PlanResult | None
    """Cost-model prediction for the chosen layout."""
    steps: tuple[LadderStep, ...]
    """The climb, in order."""
    min_gpus: int | None
    """Smallest GPU count on which the ladder finds a fitting layout (when infeasible)."""
    useful_gpus: int | None
    """Largest GPU count that data parallelism can still use under the critical batch."""
    warnings: tuple[str, ...] = field(default_factory=tuple)
    """E.g. GPUs past the useful data-parallel size."""

    def as_dict(self) -> dict[str, Any]:
        cfg = None
        if self.config is not None:
            c = self.config
            cfg = {
                "gpus": c.gpus,
                "tp": c.tp,
                "pp": c.pp,
                "dp": c.dp,
                "cp": c.cp,
                "ep": c.ep,
                "vpp": c.vpp,
                "zero": c.zero,
                "micro_batch": c.micro_batch,
                "global_batch": c.global_batch,
                "recompute": c.recompute,
            }
        return {
            "feasible": self.feasible,
            "config": cfg,
            "plan": self.result.as_dict() if self.result else None,
            "binding_wall": self.result.binding_wall if self.result else "memory",
            "mfu": self.result.mfu.as_dict() if self.result else None,
            "ladder": [{"wall": s.wall, "axis": s.axis, "detail": s.detail} for s in self.steps],
            "min_gpus": self.min_gpus,
            "useful_gpus": self.useful_gpus,
            "warnings": list(self.warnings),
        }


def _layout(
    model: ModelConfig,
    hardware: HardwareConfig,
    *,
    gpus: int,
    tp: int,
    pp: int,
    ep: int,
    zero: int,
    micro_batch: int,
    global_tokens: float,
    recompute: str,
) -> PlanInput:
    dp = gpus // (tp * pp)
    # Micro-batches per pipeline: as many as the target global batch allows, at least one.
    m = max(1, round(global_tokens / (model.seq_len * micro_batch * dp)))
    par = ParallelismConfig(
        gpus=gpus,
        tp=tp,
        pp=pp,
        dp=dp,
        ep=ep,
        zero=zero,
        micro_batch=micro_batch,
        global_batch=micro_batch * dp * m,
        recompute=recompute,
    )
    return PlanInput(model=model, parallelism=par, hardware=hardware)


def _fits(p: PlanInput) -> bool:
    return per_gpu_memory(p).fits


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _divisors(n: int, limit: int) -> Iterator[int]:
    yield from (d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _climb(
    model: ModelConfig,
    hardware: HardwareConfig,
    gpus: int,
    micro_batch: int,
    global_tokens: float,
    recompute: str,
) -> tuple[PlanInput | None, list[LadderStep]]:
    steps: list[LadderStep] = []
    usable = hardware.gpu.hbm_bytes * hardware.usable_hbm_fraction
    static = STATIC_BYTES_PER_PARAM * model.params_total

    def layout(*, tp: int, pp: int, ep: int, zero: int) -> PlanInput:
        return _layout(model, hardware, gpus=gpus, tp=tp, pp=pp, ep=ep, zero=zero, micro_batch=micro_batch,
                       global_tokens=global_tokens, recompute=recompute)

    ddp = layout(tp=1, pp=1, ep=1, zero=1)
    if static <= usable and _fits(ddp):
        return ddp, steps
    steps.append(
        LadderStep(
            wall="state > 1 GPU",
            axis="FSDP/ZeRO-3",
            detail=f"{STATIC_BYTES_PER_PARAM} B/param x {model.params_total:.3g} = "
            f"{_gib(static)} > {_gib(usable)} usable per GPU",
        )
    )
    if static > gpus * usable:
        where = "1 node" if gpus <= hardware.gpus_per_node else f"{gpus} GPUs"
        steps.append(
            LadderStep(
                wall=f"state > {where}",
                axis="(forces multi-node)",
                detail=f"{_gib(static)} of state > {gpus} x {_gib(usable)}",
            )
        )
        return None, steps
    fsdp = layout(tp=1, pp=1, ep=1, zero=3)
    if _fits(fsdp):
        return fsdp, steps

    # TP: the largest head-dividing degree that stays inside one node.
    tp = max(d for d in _divisors(gpus, hardware.gpus_per_node) if model.heads % d == 0)
    working = per_gpu_memory(fsdp)
    steps.append(
        LadderStep(
            wall="weights/GPU",
            axis="TP + FSDP",
            detail=f"FSDP alone: {_gib(working.tenants)} per GPU (gathered weights "
            f"{_gib(working.params)}, activations {_gib(working.activations)}); "
            f"tp={tp} splits both",
        )
    )
    with_tp = layout(tp=tp, pp=1, ep=1, zero=3)
    if _fits(with_tp):
        return with_tp, steps

    ep_options = [1]
    if model.experts > 1:
        dp_max = gpus // tp
        ep_options = [e for e in _divisors(model.experts, dp_max) if dp_max % e == 0]
        steps.append(
            LadderStep(
                wall="6N compute/token",
                axis="+ EP (MoE)",
                detail=f"sparse model: {model.params_active:.3g} active of "
                f"{model.params_total:.3g} params; EP shards the experts",
            )
        )
    pp_steps_added = False
    for pp in _divisors(gpus // tp, model.layers):
        for ep in ep_options:
            if (gpus // (tp * pp)) % ep:
                continue
            # With PP, ZeRO-1 first: FSDP would re-gather the stage weights for every micro-batch
            # over the inter-node fabric (seed 004, section 4); fall back to ZeRO-3 for memory.
            zeros = (1, 3) if pp > 1 else (3,)
            candidates = [layout(tp=tp, pp=pp, ep=ep, zero=z) for z in zeros]
            if pp > 1 and not pp_steps_added:
                at_tp = per_gpu_memory(layout(tp=tp, pp=1, ep=max(ep_options), zero=3))
                steps.append(
                    LadderStep(
                        wall="weights > TP alone",
                        axis="+ PP",
                        detail=f"tp={tp} still needs {_gib(at_tp.tenants)} per GPU "
                        f"(weights {_gib(at_tp.params)})",
                    )
                )
                pp_steps_added = True
            for candidate in candidates:
                if _fits(candidate):
                    return candidate, steps
    return None, steps


def recommend(
    *,
    model: ModelConfig,
    hardware: HardwareConfig,
    gpus: int,
    micro_batch: int = 1,
    global_batch_tokens: float | None = None,
    recompute: str = "selective",
    critical_batch_tokens: float = DEFAULT_CRITICAL_BATCH_TOKENS,
    calibration: Calibration | None = None,
) -> Recommendation:
    """Climb the ladder for `model` on `gpus` GPUs of `hardware`."""
    if gpus < 1:
        raise ValueError(f"parallelism.gpus: must be >= 1, got {gpus}")
    target = global_batch_tokens or critical_batch_tokens
    chosen, steps = _climb(model, hardware, gpus, micro_batch, target, recompute)
    warnings: list[str] = []
    if chosen is None:
        min_gpus = _min_gpus(model, hardware, gpus, micro_batch, target, recompute)
        if min_gpus is not None:
            warnings.append(f"does not fit on {gpus} GPUs; the ladder needs at least {min_gpus}")
        return Recommendation(
            feasible=False,
            config=None,
            result=None,
            steps=tuple(steps),
            min_gpus=min_gpus,
            useful_gpus=None,
            warnings=tuple(warnings),
        )
    par = chosen.parallelism
    result = plan(chosen, calibration)
    # DP cap (seed 000 / 07b): one micro-batch per data-parallel rank already makes this batch.
    min_batch_tokens = par.dp * par.micro_batch * model.seq_len
    useful_dp = max(1, math.floor(critical_batch_tokens / (par.micro_batch * model.seq_len)))
    useful_gpus = min(gpus, useful_dp * par.tp * par.pp)
    if min_batch_tokens > critical_batch_tokens:
        warnings.append(
            f"past the useful data-parallel size: dp={par.dp} makes at least "
            f"{min_batch_tokens:,} tokens per step > critical batch "
            f"{critical_batch_tokens:,.0f}; GPUs beyond ~{useful_gpus} add little"
        )
    if par.pp > 1:
        bubble = (par.pp - 1) / (par.micro_batches * par.vpp + par.pp - 1)
        if bubble > 0.1:
            warnings.append(
                f"pipeline bubble {bubble:.0%} with m={par.micro_batches} micro-batches; "
                "raise the micro-batch count or use interleaving (vpp)"
            )
    return Recommendation(
        feasible=True,
        config=par,
        result=result,
        steps=tuple(steps),
        min_gpus=None,
        useful_gpus=useful_gpus,
        warnings=tuple(warnings + list(result.warnings)),
    )


def _min_gpus(
    model: ModelConfig, hardware: HardwareConfig, start: int, micro_batch: int, target: float, recompute: str
) -> int | None:
    # Lower bound: the 16 B/param state must fit in the usable HBM of all GPUs together.
    usable = hardware.gpu.hbm_bytes * hardware.usable_hbm_fraction
    per_node = hardware.gpus_per_node
    nodes = max(1, math.ceil(STATIC_BYTES_PER_PARAM * model.params_total / usable / per_node))
    for n_nodes in range(nodes, nodes + 4096):
        n = n_nodes * per_node
        if n <= start:
            continue
        if _climb(model, hardware, n, micro_batch, target, recompute)[0] is not None:
            return n
    return None


def recommend_from_config(
    data: dict[str, Any], *, critical_batch_tokens: float = DEFAULT_CRITICAL_BATCH_TOKENS
) -> Recommendation:
    """`recommend` from a plan-config dict (model / parallelism / hardware keys), as the CLI's
    `plan --recommend` and the HTTP API take it; ValueError names a bad or missing key."""
    par = data.get("parallelism") or {}
    gpus = par.get("gpus", par.get("world_size", (data.get("hardware") or {}).get("gpus")))
    if not isinstance(gpus, int):
        raise ValueError("parallelism.gpus: required (an integer) for a recommendation")
    model = parse_model(data)
    global_batch = par.get("global_batch")
    return recommend(
        model=model,
        hardware=parse_hardware(data),
        gpus=gpus,
        micro_batch=int(par.get("micro_batch", 1)),
        global_batch_tokens=global_batch * model.seq_len if global_batch else None,
        recompute=str(par.get("recompute", "selective")),
        critical_batch_tokens=critical_batch_tokens,
    )
