"""Recommend a parallelism layout by climbing the ladder of seeds 000 and 003.

At each rung: compute the bill, find the wall that binds, add the cheapest axis that relieves it,
re-check. Order: plain data parallelism while the replicated state fits one GPU; ZeRO sharding
across all GPUs; TP inside the node (up to the node size); CP for a long sequence whose activations
outgrow the weights (seed 003's 128K case); EP for sparse (MoE) models; PP across nodes when TP
alone cannot hold the weights, with degrees that divide the layers first (uneven stages, and their
cost, only when none fits); data parallelism takes whatever GPUs remain. Within a rung the sharding
(ZeRO-1/2/3) and interleaving are the fastest fitting candidates by the cost model's own step time,
not a fixed rule. A layout that fits but is bound by exposed data-parallel traffic is held while the
ladder climbs on, and the fastest of the held and final layouts is the answer. Memory is checked
against the usable share of HBM (75% by default, seed 001).

    >>> from trainvitals.service.advisors.model_config import parse_model, parse_hardware
    >>> cfg = {"model": {"layers": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "seq_len": 4096,
    ...                  "params": 7e9}, "hardware": {"gpu": "H100-SXM"}}
    >>> rec = recommend(model=parse_model(cfg), hardware=parse_hardware(cfg), gpus=8)
    >>> (rec.config.tp, rec.config.pp, rec.config.dp, rec.steps[0].wall)
    (1, 1, 8, 'state > 1 GPU')
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from trainvitals.service.advisors.cost_model import Calibration, PlanResult, plan
from trainvitals.service.advisors.memory import BYTES_GRAD, BYTES_OPTIM, BYTES_PARAM, per_gpu_memory
from trainvitals.service.advisors.model_config import (
    HardwareConfig,
    ModelConfig,
    ParallelismConfig,
    PlanInput,
    default_vpp,
    parse_hardware,
    parse_model,
    parse_recommend_parallelism,
)

STATIC_BYTES_PER_PARAM = BYTES_PARAM + BYTES_GRAD + BYTES_OPTIM  # 16 for bf16 + AdamW
DEFAULT_CRITICAL_BATCH_TOKENS = 2 * 1024 * 1024  # seed 000: "a 2M-token critical batch"
LONG_SEQUENCE = 32768  # from here on, a sequence's activations can outgrow the weights (seed 003)
LONG_SEQUENCE_HEADROOM = 0.9


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
                "uneven_stages": c.uneven_stages,
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
    cp: int = 1,
    interleave: bool = True,
) -> PlanInput | None:
    """The layout, or None when it is not a valid one (ep not dividing dp, ...)."""
    dp = gpus // (tp * pp * cp)
    if dp < 1 or gpus % (tp * pp * cp) or dp % ep:
        return None
    # Micro-batches per pipeline: as many as the target global batch allows, at least one.
    m = max(1, round(global_tokens / (model.seq_len * micro_batch * dp)))
    vpp = default_vpp(layers=model.layers, pp=pp, micro_batches=m)[0] if interleave else 1
    uneven = bool(model.layers % pp)
    if not uneven and model.layers % (pp * vpp):
        vpp = 1
    # One framework for every candidate, so the choice between them weighs traffic, not kernels.
    par = ParallelismConfig(
        gpus=gpus,
        tp=tp,
        pp=pp,
        dp=dp,
        cp=cp,
        ep=ep,
        vpp=vpp,
        zero=zero,
        micro_batch=micro_batch,
        global_batch=micro_batch * dp * m,
        recompute=recompute,
        uneven_stages=uneven,
        framework="megatron",
    )
    return PlanInput(model=model, parallelism=par, hardware=hardware)


def _fits(p: PlanInput, headroom: float = 1.0) -> bool:
    """Fits, with the tenants at most `headroom` of the usable HBM."""
    mem = per_gpu_memory(p)
    return mem.fits and mem.tenants <= headroom * (mem.capacity - mem.overhead)


def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB"


def _divisors(n: int, limit: int) -> Iterator[int]:
    yield from (d for d in range(1, min(n, limit) + 1) if n % d == 0)


def _shard_name(zero: int) -> str:
    return {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}[zero]


@dataclass(kw_only=True, slots=True)
class _Choice:
    """The fastest fitting candidate of a rung, and what the others would have cost."""

    layout: PlanInput | None
    comparison: str


def _best(candidates: Iterable[PlanInput | None], calibration: Calibration | None, headroom: float = 1.0
          ) -> _Choice:
    # The sharding (and interleaving) is chosen on the cost model's own step time, not by rule.
    scored: list[tuple[float, PlanInput]] = []
    notes: list[str] = []
    for c in candidates:
        if c is None:
            continue
        name = _shard_name(c.parallelism.zero) + (f" vpp={c.parallelism.vpp}" if c.parallelism.vpp > 1 else "")
        if not _fits(c, headroom):
            notes.append(f"{name}: does not fit" + (f" in {headroom:.0%} of usable HBM" if headroom < 1 else ""))
            continue
        tokens = plan(c, calibration).tokens_per_s
        scored.append((tokens, c))
        notes.append(f"{name}: {tokens:,.0f} tok/s")
    if not scored:
        return _Choice(layout=None, comparison="; ".join(dict.fromkeys(notes)))
    # Candidates alike in what the note names (the same sharding at another stage split) say it once.
    return _Choice(layout=max(scored, key=lambda sc: sc[0])[1], comparison="; ".join(dict.fromkeys(notes)))


def _note_choice(steps: list[LadderStep], choice: _Choice) -> None:
    if choice.layout is not None and steps:
        last = steps[-1]
        steps[-1] = LadderStep(wall=last.wall, axis=last.axis,
                               detail=f"{last.detail}; chose by predicted throughput ({choice.comparison})")


def _climb(
    model: ModelConfig,
    hardware: HardwareConfig,
    gpus: int,
    micro_batch: int,
    global_tokens: float,
    recompute: str,
    calibration: Calibration | None = None,
) -> tuple[PlanInput | None, list[LadderStep]]:
    steps: list[LadderStep] = []
    usable = hardware.gpu.hbm_bytes * hardware.usable_hbm_fraction
    static = STATIC_BYTES_PER_PARAM * model.params_total

    def layout(*, tp: int = 1, pp: int = 1, ep: int = 1, cp: int = 1, zero: int, interleave: bool = True
               ) -> PlanInput | None:
        return _layout(model, hardware, gpus=gpus, tp=tp, pp=pp, ep=ep, cp=cp, zero=zero,
                       micro_batch=micro_batch, global_tokens=global_tokens, recompute=recompute,
                       interleave=interleave)

    # A long sequence's activation tensors fragment the allocator (seed 001: 5-15%): keep 10% spare.
    headroom = LONG_SEQUENCE_HEADROOM if model.seq_len >= LONG_SEQUENCE else 1.0

    def best(*, tp: int = 1, cp: int = 1) -> _Choice:
        return _best((layout(tp=tp, cp=cp, zero=z) for z in (1, 2, 3)), calibration, headroom)

    # A layout that fits but whose binding wall is exposed data-parallel traffic (FSDP gathering a
    # big model across nodes every micro-batch) is held, and the ladder climbs on: the next axis
    # (TP, PP) shrinks that traffic. The fastest held or final layout is the answer.
    held: list[tuple[float, PlanInput]] = []

    def settle(choice: _Choice) -> PlanInput | None:
        """The answer when the ladder stops at this choice, None to climb on."""
        assert choice.layout is not None
        _note_choice(steps, choice)
        result = plan(choice.layout, calibration)
        if result.binding_wall != "dp_comm":
            return _fastest(held, (result.tokens_per_s, choice.layout), steps)
        held.append((result.tokens_per_s, choice.layout))
        steps.append(LadderStep(
            wall="exposed DP traffic",
            axis="(climb on)",
            detail=f"{result.step.dp_comm_exposed_s:.2f} s of {result.step.total_s:.2f} s per step waits on "
            "data-parallel traffic; the next axis may shrink it",
        ))
        return None

    if static <= usable:
        choice = _best((layout(zero=z) for z in (0, 1)), calibration)
        if choice.layout is not None:
            return choice.layout, steps
    steps.append(
        LadderStep(
            wall="state > 1 GPU",
            axis="ZeRO/FSDP sharding",
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
    choice = best()
    if choice.layout is not None and (answer := settle(choice)) is not None:
        return answer, steps

    # TP: the largest degree that splits the heads (KV heads whole or replicated) inside one node.
    tp = max(d for d in _divisors(gpus, hardware.gpus_per_node) if model.allows_tp(d))
    fsdp = layout(zero=3)
    working = per_gpu_memory(fsdp) if fsdp is not None else None
    steps.append(
        LadderStep(
            wall="weights/GPU",
            axis="TP + sharding",
            detail=(f"FSDP alone: {_gib(working.tenants)} per GPU (gathered weights "
                    f"{_gib(working.params)}, activations {_gib(working.activations)}); " if working else "")
            + f"tp={tp} splits both",
        )
    )
    choice = best(tp=tp)
    if choice.layout is not None and (answer := settle(choice)) is not None:
        return answer, steps

    # CP: a long sequence whose activations, not weights, fill the GPU (seed 003's 128K case).
    cps = [1]
    probe_layout = layout(tp=tp, zero=3)
    probe = per_gpu_memory(probe_layout) if probe_layout is not None else None
    if (probe is not None and model.seq_len >= LONG_SEQUENCE
            and probe.activations > probe.params + probe.grads + probe.optimizer):
        cps = [c for c in _divisors(gpus // tp, gpus) if model.seq_len % c == 0]
        steps.append(
            LadderStep(
                wall="activations/GPU (long sequence)",
                axis="+ CP (ring attention)",
                detail=f"seq_len={model.seq_len}: activations {_gib(probe.activations)} per GPU at tp={tp} "
                f"> weights + state {_gib(probe.params + probe.grads + probe.optimizer)}; CP splits the sequence",
            )
        )
        for cp in cps[1:]:
            choice = best(tp=tp, cp=cp)
            if choice.layout is not None:
                _note_choice(steps, choice)
                return _fastest(held, (plan(choice.layout, calibration).tokens_per_s, choice.layout), steps), steps

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
    # PP: degrees that divide the layers first; uneven stages (and their cost) only when none fits.
    degrees = [d for d in _divisors(gpus // tp, model.layers) if d > 1]
    ordered = [d for d in degrees if model.layers % d == 0] + [d for d in degrees if model.layers % d]
    pp_step_added = False
    for pp in ordered:
        for cp in cps:
            for ep in ep_options:
                if not pp_step_added:
                    probe_tp = layout(tp=tp, ep=max(ep_options), zero=3) or layout(tp=tp, zero=3)
                    assert probe_tp is not None  # tp divides gpus, so the plain TP layout exists
                    at_tp = per_gpu_memory(probe_tp)
                    steps.append(
                        LadderStep(
                            wall="weights > TP alone",
                            axis="+ PP",
                            detail=(f"tp={tp} fits, but every data-parallel rank moves its weights each "
                                    "micro-batch; PP divides them" if held else
                                    f"tp={tp} still needs {_gib(at_tp.tenants)} per GPU "
                                    f"(weights {_gib(at_tp.params)})"),
                        )
                    )
                    pp_step_added = True
                candidates = [layout(tp=tp, pp=pp, cp=cp, ep=ep, zero=z, interleave=i)
                              for z in (1, 2, 3) for i in (True, False)]
                choice = _best(candidates, calibration, headroom)
                if choice.layout is None:
                    continue
                _note_choice(steps, choice)
                final = (plan(choice.layout, calibration).tokens_per_s, choice.layout)
                if held and _fastest(held, final, []) is not choice.layout:
                    return _fastest(held, final, steps), steps
                if model.layers % pp:
                    fullest = -(-model.layers // pp)
                    steps.append(
                        LadderStep(
                            wall=f"no pp dividing {model.layers} layers fits",
                            axis="uneven stages",
                            detail=f"pp={pp}: the fullest stage holds {fullest} layers vs "
                            f"{model.layers / pp:.2f} on average (+{fullest / (model.layers / pp) - 1:.1%} step time)",
                        )
                    )
                return choice.layout, steps
    return (_fastest(held[:-1], held[-1], steps) if held else None), steps


def _fastest(held: list[tuple[float, PlanInput]], final: tuple[float, PlanInput], steps: list[LadderStep]
             ) -> PlanInput:
    """The fastest of the held layouts and the final one; a step says when a held one wins."""
    tokens, chosen = max([*held, final], key=lambda tc: tc[0])
    if chosen is not final[1]:
        c = chosen.parallelism
        steps.append(LadderStep(
            wall="exposed DP traffic",
            axis="kept the faster layout",
            detail=f"tp={c.tp} pp={c.pp} dp={c.dp} {_shard_name(c.zero)}: {tokens:,.0f} tok/s vs "
            f"{final[0]:,.0f} tok/s one rung up",
        ))
    return chosen


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
    chosen, steps = _climb(model, hardware, gpus, micro_batch, target, recompute, calibration)
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
    useful_gpus = min(gpus, useful_dp * par.tp * par.pp * par.cp)  # a replica's GPUs include its CP ranks
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
    model = parse_model(data)
    hardware = parse_hardware(data)
    target = parse_recommend_parallelism(data)
    return recommend(
        model=model,
        hardware=hardware,
        gpus=target.gpus,
        micro_batch=target.micro_batch,
        global_batch_tokens=target.global_batch * model.seq_len if target.global_batch else None,
        recompute=target.recompute,
        critical_batch_tokens=critical_batch_tokens,
    )
