"""Synthetic multi-rank training runs for evaluating the detectors: healthy noisy runs and runs with
injected faults, each with the step the fault was injected at and the step the loss starts to move
(so lead time can be measured). Pure and seeded: the same (family, seed) gives the same run.

The shapes follow the reference notes (docs/detectors.md lists them): loss a decaying power law with
multiplicative noise; gradient norm high in warm-up, then a slowly wandering level with per-step
log-normal (or Student-t) noise; per-rank compute times log-normal with rare hiccups, every rank's
step as long as the slowest rank's plus communication; FP8 tensors under delayed scaling
(H = margin + log2(A_{t-1} / amax_t), A the max over an L-step history); checkpoints every 500 steps.

Usage::

    sc = make_scenario("late_divergence", seed=3)
    findings = detect(sc.series)
    lines = list(to_wire_lines(sc))        # RunRegistration, then Batch lines per rank (wire v1)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainvitals.service.detectors.findings import Finding
from trainvitals.service.detectors.series import (
    CheckpointEvent,
    GroupGradNorms,
    RankSteps,
    RunEvent,
    RunSeries,
    RunSteps,
    TensorSeries,
)
from trainvitals.service.store import run_keys
from trainvitals.wire.conventions import FP8_MAX, GLOBAL_GROUP, layer_of
from trainvitals.wire.v1 import (
    Batch,
    CheckpointRecord,
    CheckpointSettings,
    EventRecord,
    Fp8Recipe,
    GradRecord,
    Hardware,
    ModelDims,
    Parallelism,
    RunRegistration,
    StepRecord,
    TensorRecord,
)

HEALTHY_FAMILIES = (
    "healthy_plain",
    "healthy_burst",
    "healthy_resume",
    "healthy_end_rise",
    "healthy_heavy_tail",
    "healthy_phase_change",
    "healthy_loss_bump",
    "healthy_shared_host",
    "healthy_long",
)
"""Runs that must never page."""

LONG_HEALTHY_STEPS = 100_000
"""Length of `healthy_long` (issue 13: healthy runs of 100,000 steps with benign bursts)."""

FAULT_FAMILIES = (
    "late_divergence",
    "fp8_amax_creep",
    "fp8_jump",
    "straggler",
    "intermittent_straggler",
    "slow_stage",
    "mfu_gap",
    "checkpoint_failed",
    "stalled",
    "nonfinite_grads",
    "loss_bump_persistent",
    "loss_bump_recurring",
    "loss_ramp",
    "fp8_headroom_exhaustion",
    "fp8_sporadic_saturation",
    "slow_stage_10pct",
    "shared_host_straggler",
)
"""Runs with one injected fault each."""

T0 = 1_750_000_000.0
"""Unix seconds of step 0 (fixed: scenarios are deterministic)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class Layout:
    """Shape of the synthetic job."""

    pp: int = 2
    dp: int = 4
    ranks_per_node: int = 4
    layers: int = 6
    groups: int = 8
    """Gradient-norm parameter groups."""
    history_len: int = 16
    """FP8 delayed-scaling amax history L ('max' algorithm, margin 0)."""
    peak_flops: float = 989e12
    """Per device (H100 SXM dense bf16)."""
    params: int = 600_000_000
    tokens_per_rank: int = 2**17
    """Tokens a step per rank: 2**20 a step for the default 8 ranks. Per rank, so that any layout's
    MFU is the default's ~40% (a 2-rank job doing the 8-rank job's tokens read 160%, which the
    `mfu_impossible` detector rightly calls a miscount)."""
    checkpoint_every: int = 500
    expensive_every: int = 10
    """FP8 saturation/underflow fractions are measured every this many steps (the agent's tier 2)."""

    @property
    def world(self) -> int:
        return self.pp * self.dp


@dataclass(kw_only=True, slots=True, frozen=True)
class Scenario:
    """A synthetic run and what was done to it."""

    name: str
    family: str
    seed: int
    healthy: bool
    series: RunSeries
    layout: Layout
    injected_step: int | None = None
    """Step the fault starts (None: healthy)."""
    loss_move_step: int | None = None
    """Step the loss starts to move because of the fault (None: it never does)."""
    expect_kinds: tuple[str, ...] = ()
    """Finding kinds any of which counts as detecting the fault."""
    expect_subject: str | None = None
    """Subject the finding must name (rank, tensor 'fqn:role', stage), when the fault has one."""
    forbid_kinds: tuple[str, ...] = ()
    """Kinds that would be a misdiagnosis (e.g. a rank straggler for a slow stage)."""
    expect_page: bool = False
    """Detection needs the expected finding to page (a ticket is not enough)."""
    incarnation_from: dict[int, int] = field(default_factory=dict)
    """Step -> incarnation starting there (resumes), for the wire conversion."""


# --------------------------------------------------------------------------- the base run


class _Recipe(np.random.Generator):
    """A family's generator (its recipe: where and how big the bumps, spikes and faults are) with a
    second one for the base run's per-step noise (`make_scenario(noise_seed=...)`)."""

    def __init__(self, seed: list[int], noise_seed: int) -> None:
        super().__init__(np.random.PCG64(seed))
        self.noise = np.random.default_rng([noise_seed, *seed])


class _Run:
    """Mutable arrays of one run while a family shapes it (private to this module)."""

    def __init__(self, rng: np.random.Generator, n: int, layout: Layout, *, heavy_tail: bool = False) -> None:
        self.rng, self.n, self.layout = rng, n, layout
        # make_scenario(noise_seed=...): the base run's noise comes from a generator of its own, and
        # the recipe's generator is advanced exactly as drawing that noise would have, so every later
        # draw (where and how big the bumps, spikes and faults are) matches the run of the same seed.
        self.noise = rng.noise if isinstance(rng, _Recipe) else rng
        if self.noise is not rng:
            _Run(np.random.Generator(rng.bit_generator), n, layout, heavy_tail=heavy_tail)
        rng = self.noise
        t = np.arange(n, dtype=float)
        self.steps = np.arange(n, dtype=np.int64)
        # Loss: power-law decay, ~1.5% multiplicative noise (Student-t df 3 when heavy-tailed).
        self.log_loss = np.log(2.1 + 2.5 * np.exp(-t / 400) + 1.2 / np.sqrt(1 + t / 200))
        self.log_loss += self._noise(0.012 if not heavy_tail else 0.008, heavy_tail)
        # Gradient norm: high during warm-up, a slowly wandering level, per-step noise.
        phi = 0.995
        innov = rng.normal(0, 0.03 * math.sqrt(1 - phi**2), n)
        wander = np.zeros(n)
        for i in range(1, n):
            wander[i] = phi * wander[i - 1] + innov[i]
        self.log_gn = math.log(0.8) + 1.2 * np.exp(-t / 250) + wander
        self.log_gn += self._noise(0.07 if not heavy_tail else 0.05, heavy_tail)
        self.spike_group = np.full(n, -1, dtype=np.int64)
        """Group carrying a spike at that step (-1: none): spikes are localised in one layer."""
        self.group_weights = rng.dirichlet(np.full(layout.groups, 5.0))
        self.nonfinite_group = np.full(n, -1, dtype=np.int64)
        self.loss_nonfinite = np.zeros(n, dtype=np.int64)
        # Per-rank timing: stage base times within 3%, log-normal noise, rare hiccups.
        ranks = layout.world
        self.stage = np.repeat(np.arange(layout.pp), layout.dp)
        stage_base = 1.0 + rng.uniform(-0.03, 0.03, layout.pp)
        self.compute = stage_base[self.stage][None, :] * np.exp(rng.normal(0, 0.015, (n, ranks)))
        hiccup = rng.random((n, ranks)) < 0.003
        self.compute[hiccup] *= rng.uniform(1.1, 1.5, hiccup.sum())
        self.comm = 0.15 * np.exp(rng.normal(0, 0.05, n))
        self.extra_seconds = np.zeros(n)
        """Job-level time added to a step (checkpoint stalls, restarts)."""
        # FP8 tensors: log2 amax per tensor (input, weight, grad_output per layer).
        self.tensor_names: list[tuple[str, str, str]] = []
        rows = []
        for layer in range(layout.layers):
            fqn = f"layers.{layer}.mlp.fc1"
            self.tensor_names += [
                (fqn, "input", "e4m3"),
                (fqn, "weight", "e4m3"),
                (fqn, "grad_output", "e5m2"),
            ]
            rows.append(3.0 + 0.3 * layer + rng.normal(0, 0.08, n) + 0.3 * wander)
            rows.append(-1.0 + 0.05 * layer + 0.1 * np.tanh(t / 3000) + rng.normal(0, 0.005, n))
            # Gradients scale with the gradient norm (in bits: / ln 2), plus their own noise.
            rows.append(-12.0 + 0.4 * (self.log_gn - math.log(0.8)) / math.log(2) + rng.normal(0, 0.25, n))
        self.log2_amax = np.stack(rows)
        self.tensor_nonfinite = np.zeros_like(self.log2_amax)
        self.headroom_offset = np.zeros_like(self.log2_amax)
        """Bits added to a tensor's headroom: the margin a scale leaves above the amax (a recipe
        whose scale does not follow the amax, e.g. calibrated once), eaten by amax growth."""
        self.history_len = np.full(len(rows), layout.history_len, dtype=np.int64)
        self.events: list[RunEvent] = []
        self.checkpoint_fail_from: int | None = None
        self.incarnation_from: dict[int, int] = {}
        self.resume_at: int | None = None
        self.restart_gap = 600.0
        """Seconds between the last step before a failure and the first one after the resume."""

    def _noise(self, scale: float, heavy_tail: bool) -> np.ndarray:
        if heavy_tail:
            return scale * self.noise.standard_t(3, self.n)
        return self.noise.normal(0, scale, self.n)

    def add_loss_bump(self, step: int, nats: float, rise_steps: int, decay_steps: float) -> None:
        """A benign loss bump (BLOOM / OPT logbooks): +`nats` reached over `rise_steps`, then an
        exponential decay back with time constant `decay_steps`."""
        x = np.arange(self.n, dtype=float) - step
        up = np.clip(x / max(rise_steps, 1), 0.0, 1.0)
        down = np.exp(-np.clip(x - rise_steps, 0.0, None) / decay_steps)
        self.log_loss += np.where(x >= 0, nats * up * down, 0.0)

    def add_contention(self) -> None:
        """Step times of ranks sharing a host (4 ranks on 2 cores): heavier-tailed per-step noise,
        sporadic slow steps on every rank, and now and then a stretch where one rank gets fewer
        cycles (100-300 steps, 10-20% of them 1.3-1.6x). None of it costs the job 5% over 1,000
        steps: all of it is benign noise the straggler detectors may ticket but must not page."""
        rng, n, ranks = self.rng, self.n, self.layout.world
        self.compute *= np.exp(0.01 * rng.standard_t(3, (n, ranks)))
        sporadic = rng.random((n, ranks)) < 0.02
        self.compute[sporadic] *= rng.uniform(1.2, 1.8, int(sporadic.sum()))
        at = 0
        while True:
            at += int(rng.integers(800, 2500))
            if at >= n:
                break
            rank = int(rng.integers(0, ranks))
            length = int(rng.integers(100, 301))
            rows = np.arange(at, min(at + length, n))
            slow = rng.random(len(rows)) < float(rng.uniform(0.10, 0.20))
            self.compute[rows[slow], rank] *= rng.uniform(1.3, 1.6, int(slow.sum()))

    def tensor_index(self, fqn: str, role: str) -> int:
        return next(i for i, (f, r, _) in enumerate(self.tensor_names) if f == fqn and r == role)

    def add_spike(self, step: int, ratio: float, group: int) -> None:
        """Raise the global norm at `step` by `ratio`, carried by one group."""
        self.log_gn[step] += math.log(ratio)
        self.spike_group[step] = group
        gi = [i for i, (_, r, _) in enumerate(self.tensor_names) if r == "grad_output"]
        self.log2_amax[gi[group % len(gi)], step] += 0.5 * math.log2(ratio)

    # ----------------------------------------------------------------------- assembly

    def _fp8(self) -> list[TensorSeries]:
        out = []
        lay = self.layout
        expensive = (self.steps % lay.expensive_every) == 0
        for k, (fqn, role, fmt) in enumerate(self.tensor_names):
            x = self.log2_amax[k]
            L = int(self.history_len[k])
            padded = np.concatenate([np.full(L, x[0]), x])
            # A_{t-1}: max over the L amaxes before step t (the scale used at t was built from them).
            hist = np.lib.stride_tricks.sliding_window_view(padded, L)[: self.n].max(axis=1)
            # A resume restores the history with the checkpoint: no discontinuity to model.
            headroom = hist - x + self.headroom_offset[k]
            lag = x - hist
            sat = np.where(headroom < 0, 1e-7 * (2.0 ** (-6 * headroom) - 1), 0.0)
            base_uf = 2e-4 if fmt == "e4m3" else 1e-4
            uf = base_uf * 2.0 ** np.maximum(headroom, 0) * np.exp(self.noise.normal(0, 0.1, self.n))
            amax = 2.0**x
            nonfinite = self.tensor_nonfinite[k].copy()
            amax = np.where(nonfinite > 0, np.inf, amax)
            out.append(
                TensorSeries(
                    tensor=fqn,
                    role=role,
                    format=fmt,
                    steps=self.steps.copy(),
                    amax=amax,
                    headroom_bits=np.where(nonfinite > 0, np.nan, headroom),
                    lag_bits=np.where(nonfinite > 0, np.nan, lag),
                    sat_frac=np.where(expensive, np.minimum(sat, 1.0), np.nan),
                    underflow_frac=np.where(expensive, np.minimum(uf, 1.0), np.nan),
                    nonfinite=nonfinite,
                    history_len=L,
                )
            )
        return out

    def build(
        self,
        *,
        name: str,
        expected_mfu_factor: float = 0.97,
        mfu_ref_end: int | None = None,
        now_after_last: float | None = None,
    ) -> RunSeries:
        lay = self.layout
        n = self.n
        ckpt_steps = np.arange(lay.checkpoint_every, n, lay.checkpoint_every)
        extra = self.extra_seconds.copy()
        extra[ckpt_steps] += 5.0  # synchronous part of each save
        job = self.compute.max(axis=1) + self.comm + extra
        ts = T0 + np.cumsum(job)
        if self.resume_at is not None:
            ts[self.resume_at :] += self.restart_gap
        wait = job[:, None] - self.compute
        step_mat = np.repeat(job[:, None], lay.world, axis=1)
        # Gradient groups: the global norm is the root sum of squares of the groups.
        gn = np.exp(self.log_gn)
        w = np.sqrt(self.group_weights)
        g_noise = np.exp(self.noise.normal(0, 0.05, (n, lay.groups)))
        groups = gn[:, None] * w[None, :] * g_noise
        sp = np.flatnonzero(self.spike_group >= 0)
        base = np.exp(self.log_gn.copy())
        for i in sp:
            # Put the spike's energy into one group so the global ratio is what add_spike asked.
            gidx = int(self.spike_group[i])
            rest = float(np.sum(groups[i] ** 2) - groups[i, gidx] ** 2)
            target = base[i] ** 2
            groups[i, gidx] = math.sqrt(max(target - rest, groups[i, gidx] ** 2))
        grad_nonfinite = np.zeros(n, dtype=np.int64)
        bad = np.flatnonzero(self.nonfinite_group >= 0)
        groups[bad, self.nonfinite_group[bad]] = np.nan
        grad_nonfinite[bad] = 37
        global_gn = np.sqrt(np.sum(groups**2, axis=1))
        loss = np.exp(self.log_loss)
        loss[self.loss_nonfinite > 0] = np.nan
        tokens = np.full(n, float(lay.tokens_per_rank * lay.world))
        flops = 6.0 * lay.params * tokens
        peak_total = lay.peak_flops * lay.world
        mfu = flops / (job * peak_total)
        ref_end = mfu_ref_end if mfu_ref_end is not None else n
        expected = round(float(np.median(mfu[300:ref_end])) / expected_mfu_factor, 4)
        interval_s = float(np.median(job)) * lay.checkpoint_every
        checkpoints = self._checkpoints(ckpt_steps, ts)
        events = [RunEvent(event="start", ts=T0, step=0)] + self.events
        now = ts[-1] + (now_after_last if now_after_last is not None else float(np.median(job)))
        nodes = [f"node{r // lay.ranks_per_node}" for r in range(lay.world)]
        return RunSeries(
            run=name,
            steps=RunSteps(
                steps=self.steps.copy(),
                loss=loss,
                grad_norm=global_gn,
                grad_nonfinite=grad_nonfinite,
                step_seconds=job,
                ts=ts,
                tokens=tokens,
                flops=flops,
                mfu=mfu,  # what the collector's reduction stores for these flops and step times
                loss_nonfinite=self.loss_nonfinite.copy(),
            ),
            groups=GroupGradNorms(
                steps=self.steps.copy(), groups=[f"layers.{g}" for g in range(lay.groups)], norms=groups
            ),
            tensors=self._fp8(),
            ranks=RankSteps(
                steps=self.steps.copy(),
                ranks=np.arange(lay.world, dtype=np.int64),
                step_seconds=step_mat,
                compute_seconds=self.compute.copy(),
                wait_seconds=wait,
                pp_stage=self.stage.astype(np.int64),
                node=nodes,
            ),
            checkpoints=checkpoints,
            events=sorted(events, key=lambda e: e.ts),
            expected_mfu=expected,
            peak_flops_total=peak_total,
            checkpoint_interval_seconds=interval_s,
            now=float(now),
        )

    def _checkpoints(self, ckpt_steps: np.ndarray, ts: np.ndarray) -> list[CheckpointEvent]:
        out = []
        for gen, st in enumerate(ckpt_steps.tolist(), start=1):
            t = float(ts[st])
            out.append(CheckpointEvent(generation=gen, step=st, status="started", ts=t, stall_seconds=5.0))
            if self.checkpoint_fail_from is not None and st >= self.checkpoint_fail_from:
                out.append(CheckpointEvent(generation=gen, step=st, status="failed", ts=t + 30.0))
                continue
            if t + 20.0 <= ts[-1]:
                out.append(
                    CheckpointEvent(
                        generation=gen,
                        step=st,
                        status="persisted",
                        ts=t + 20.0,
                        stall_seconds=5.0,
                        persist_seconds=20.0,
                    )
                )
            if t + 60.0 <= ts[-1]:
                out.append(CheckpointEvent(generation=gen, step=st, status="verified", ts=t + 60.0))
        return out


# --------------------------------------------------------------------------- families


def _ramp(n: int, start: int, end: int) -> np.ndarray:
    """0 before start, rising linearly to 1 at end, 1 after."""
    t = np.arange(n, dtype=float)
    return np.clip((t - start) / max(end - start, 1), 0.0, 1.0)


def make_scenario(family: str, seed: int, *, layout: Layout | None = None, noise_seed: int | None = None) -> Scenario:
    """Build one run of `family` (see HEALTHY_FAMILIES and FAULT_FAMILIES).

    noise_seed: the same recipe as `seed` (every bump, spike, fault and end-of-training rise at the
    same step and of the same size) with per-step noise of its own: what a previous run of the same
    job looks like, i.e. a baseline run for the scenario of `seed`."""
    lay = layout or Layout()
    # Odd seeds use a long 'max' history (TE default), even seeds a short one: both must stay quiet.
    if family.startswith("healthy") and seed % 2 == 1:
        lay = dataclasses.replace(lay, history_len=1024)
    recipe = [seed, _family_salt(family)]
    rng = np.random.default_rng(recipe) if noise_seed is None else _Recipe(recipe, noise_seed)
    name = f"synthetic-{family}-s{seed}" + ("" if noise_seed is None else f"-n{noise_seed}")
    builder = _FAMILIES.get(family)
    if builder is None:
        raise ValueError(f"unknown scenario family {family!r}")
    return builder(rng=rng, name=name, family=family, seed=seed, layout=lay)


def _family_salt(family: str) -> int:
    # Stable across processes (unlike hash()).
    return sum((i + 1) * ord(c) for i, c in enumerate(family))


def _scenario(run: _Run, *, name: str, family: str, seed: int, series: RunSeries, **kw: Any) -> Scenario:
    return Scenario(
        name=name,
        family=family,
        seed=seed,
        healthy=family.startswith("healthy"),
        series=series,
        layout=run.layout,
        incarnation_from=dict(run.incarnation_from),
        **kw,
    )


def _healthy_plain(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _healthy_burst(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    start = int(rng.integers(1500, 3500))
    k = int(rng.integers(4, 11))
    at = np.sort(start + rng.choice(150, size=k, replace=False))
    group = int(rng.integers(0, layout.groups))
    for st in at:
        run.add_spike(int(st), float(rng.uniform(2.5, 6.0)), group)
        run.log_loss[st : st + 3] += 0.03  # the loss blips with the spike and recovers
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _healthy_resume(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    fail = int(rng.integers(2000, 3500))
    resume = (fail // layout.checkpoint_every) * layout.checkpoint_every
    t = np.arange(run.n, dtype=float)
    after = t >= resume
    # Steps resume..fail are redone by the new incarnation (the series keeps the newest values);
    # re-warming optimizer state gives a short grad-norm and loss transient.
    run.log_gn += np.where(after, np.log1p(1.0 * np.exp(-(t - resume) / 15)), 0.0)
    run.log_loss += np.where(after, np.log1p(0.08 * np.exp(-(t - resume) / 40)), 0.0)
    run.resume_at = resume
    run.restart_gap = 600.0 + 1.2 * (fail - resume)  # restart plus the redone steps
    series = run.build(name=name)
    fail_ts = series.steps.ts[resume] - 600.0
    series.events += [
        RunEvent(event="failure", ts=fail_ts, step=fail, detail="synthetic: node lost", rank=3),
        RunEvent(event="rollback", ts=series.steps.ts[resume] - 1.0, step=resume, detail="from checkpoint"),
        RunEvent(event="resume", ts=series.steps.ts[resume] - 1.0, step=resume),
    ]
    series.events.sort(key=lambda e: e.ts)
    run.incarnation_from[resume] = 1
    return _scenario(run, name=name, family=family, seed=seed, series=series)


def _healthy_end_rise(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    ramp = _ramp(run.n, 3750, 5000)
    run.log_gn += math.log(float(rng.uniform(1.5, 2.0))) * ramp  # Defazio 2025: benign at the end
    run.log_loss -= 0.03 * ramp  # the LR anneal still lowers the loss
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _healthy_heavy_tail(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout, heavy_tail=True)
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _healthy_phase_change(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    at = int(rng.integers(2000, 3500))
    t = np.arange(run.n, dtype=float)
    after = t >= at
    run.log_loss += np.where(after, 0.06 * (0.5 + 0.5 * np.exp(-(t - at) / 100)), 0.0)  # new data mix
    run.log_gn += np.where(after, math.log(1.3), 0.0)
    series = run.build(name=name)
    series.events.append(
        RunEvent(event="phase_change", ts=float(series.steps.ts[at]), step=at, detail="data mix switch")
    )
    return _scenario(run, name=name, family=family, seed=seed, series=series)


def _late_divergence(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(2000, 2600))
    move = inject + int(rng.integers(1800, 2200))
    run = _Run(rng, move + 400, layout)
    group = int(rng.integers(0, layout.groups))
    st = inject
    while st < move:
        for _ in range(int(rng.integers(1, 3))):
            run.add_spike(st, float(rng.uniform(2.5, 8.0)), group)
            st += int(rng.integers(1, 5))
        st += int(rng.integers(80, 250))
    run.log_gn += math.log(1.6) * _ramp(run.n, inject, move)
    t = np.arange(run.n, dtype=float)
    past = np.clip(t - move, 0, None) / 300
    run.log_loss += 0.7 * past**2
    run.log_gn += 2.0 * past
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name),
        injected_step=inject,
        loss_move_step=move,
        expect_kinds=("grad_spikes_recurring", "grad_norm_drift"),
    )


def _fp8_amax_creep(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(1500, 2500))
    move = inject + 2500
    run = _Run(rng, move + 400, layout)
    layer = int(rng.integers(0, layout.layers))
    k = run.tensor_index(f"layers.{layer}.mlp.fc1", "input")
    ramp = _ramp(run.n, inject, move)
    # Outliers emerge (Fishman et al. 2024: sporadic SwiGLU activation outliers late in training):
    # the amax creeps up and sporadic outliers grow in rate (to 5% of steps) and size (to ~2.5 bits).
    # Each outlier under a short history lands on a scale set without it: negative headroom that
    # deepens block after block until it clips.
    outlier = rng.random(run.n) < 0.05 * ramp
    run.log2_amax[k] += 1.0 * ramp + np.where(outlier, ramp * rng.uniform(1.5, 2.5, run.n), 0.0)
    t = np.arange(run.n, dtype=float)
    run.log_loss += 0.6 * (np.clip(t - move, 0, None) / 300) ** 2
    subject = f"layers.{layer}.mlp.fc1:input"
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name),
        injected_step=inject,
        loss_move_step=move,
        expect_subject=subject,
        expect_kinds=("fp8_headroom_trend", "fp8_clipping"),
    )


def _fp8_jump(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    lay = dataclasses.replace(layout, history_len=1024)
    inject = int(rng.integers(1500, 2500))
    move = inject + 1200
    run = _Run(rng, move + 400, lay)
    layer = int(rng.integers(0, lay.layers))
    k = run.tensor_index(f"layers.{layer}.mlp.fc1", "input")
    # One sudden outlier (10-20x): it clips once, then the 'max' history holds the scale too low
    # for up to L steps, so small values flush to zero and the loss degrades later.
    run.log2_amax[k, inject] += math.log2(float(rng.uniform(10, 20)))
    t = np.arange(run.n, dtype=float)
    run.log_loss += 0.6 * (np.clip(t - move, 0, None) / 300) ** 2
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name),
        injected_step=inject,
        loss_move_step=move,
        expect_subject=f"layers.{layer}.mlp.fc1:input",
        expect_kinds=("fp8_jump", "fp8_clipping", "fp8_stale_scale", "fp8_underflow_rise"),
    )


def _straggler(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    run = _Run(rng, 4000, layout)
    inject = int(rng.integers(1500, 2500))
    rank = int(rng.integers(0, layout.world))
    run.compute[inject:, rank] *= float(rng.uniform(1.2, 1.4))  # thermal throttling, a bad HBM stack
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name, mfu_ref_end=inject),
        injected_step=inject,
        expect_kinds=("straggler",),
        expect_subject=str(rank),
        forbid_kinds=("stage_imbalance",),
    )


def _intermittent_straggler(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 4000, layout)
    inject = int(rng.integers(1500, 2500))
    rank = int(rng.integers(0, layout.world))
    slow = rng.random(run.n - inject) < float(rng.uniform(0.08, 0.15))
    run.compute[inject:, rank] *= np.where(
        slow, float(rng.uniform(1.6, 2.2)), 1.0
    )  # a flaky NIC, host jitter
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name, mfu_ref_end=inject),
        injected_step=inject,
        expect_kinds=("straggler_intermittent", "straggler"),
        expect_subject=str(rank),
        forbid_kinds=("stage_imbalance",),
    )


def _slow_stage(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    run = _Run(rng, 4000, layout)
    inject = int(rng.integers(1500, 2500))
    stage = int(rng.integers(0, layout.pp))
    run.compute[inject:, run.stage == stage] *= float(rng.uniform(1.25, 1.4))  # e.g. a longer-sequence shard
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name, mfu_ref_end=inject),
        injected_step=inject,
        expect_kinds=("stage_imbalance",),
        expect_subject=str(stage),
        forbid_kinds=("straggler", "straggler_intermittent"),
    )


def _mfu_gap(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    run = _Run(rng, 4000, layout)
    inject = int(rng.integers(1500, 2500))
    run.comm[inject:] += float(rng.uniform(0.4, 0.6))  # a degraded inter-node link slows every rank alike
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name, mfu_ref_end=inject),
        injected_step=inject,
        expect_kinds=("mfu_gap",),
        forbid_kinds=("straggler", "straggler_intermittent", "stage_imbalance"),
    )


def _checkpoint_failed(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 4000, layout)
    inject = (
        int(rng.integers(4, 6)) * layout.checkpoint_every
    )  # storage quota hit: every save from here fails
    run.checkpoint_fail_from = inject
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name),
        injected_step=inject,
        expect_kinds=("checkpoint_failed",),
    )


def _stalled(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    inject = int(rng.integers(2000, 3000))
    run = _Run(rng, inject, layout)  # no step after `inject - 1`: a hung collective
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name, now_after_last=float(rng.uniform(900, 1800))),
        injected_step=inject - 1,
        expect_kinds=("run_stalled",),
        forbid_kinds=("checkpoint_overdue",),
    )


def _nonfinite_grads(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(2000, 3000))
    run = _Run(rng, inject + 50, layout)
    group = int(rng.integers(0, layout.groups))
    run.nonfinite_group[inject : inject + 3] = group
    run.loss_nonfinite[inject + 1 :] = layout.dp  # the NaN reached the weights
    gi = [i for i, (_, r, _) in enumerate(run.tensor_names) if r == "grad_output"]
    run.tensor_nonfinite[gi[group % len(gi)], inject : inject + 3] = 12
    return _scenario(
        run,
        name=name,
        family=family,
        seed=seed,
        series=run.build(name=name),
        injected_step=inject,
        loss_move_step=inject + 1,
        expect_kinds=("grad_nonfinite", "fp8_nonfinite"),
    )


def _healthy_loss_bump(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    at = int(rng.integers(1500, 3500))
    _benign_bump(run, at)
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _benign_bump(run: _Run, at: int) -> None:
    """One loss bump of ~0.5 nats that recovers within a few hundred steps, with the gradient
    spikes that usually come with it (the kind BLOOM and OPT logbooks call benign)."""
    rng = run.rng
    run.add_loss_bump(at, float(rng.uniform(0.4, 0.6)), int(rng.integers(0, 51)), float(rng.uniform(40, 100)))
    group = int(rng.integers(0, run.layout.groups))
    for st in at + np.sort(rng.choice(30, size=int(rng.integers(1, 4)), replace=False)):
        run.add_spike(int(st), float(rng.uniform(2.5, 6.0)), group)


def _healthy_shared_host(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 5000, layout)
    run.add_contention()
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _healthy_long(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    """100,000 steps: shared-host step times, and every 12k-25k steps a benign loss bump or a
    recovering gradient burst."""
    run = _Run(rng, LONG_HEALTHY_STEPS, layout)
    run.add_contention()
    at = 0
    while True:
        at += int(rng.integers(12_000, 25_000))
        if at >= run.n - 1000:
            break
        if rng.random() < 0.5:
            _benign_bump(run, at)
        else:
            group = int(rng.integers(0, layout.groups))
            for st in np.sort(at + rng.choice(150, size=int(rng.integers(4, 11)), replace=False)):
                run.add_spike(int(st), float(rng.uniform(2.5, 6.0)), group)
    return _scenario(run, name=name, family=family, seed=seed, series=run.build(name=name))


def _loss_bump_persistent(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(2500, 3500))
    run = _Run(rng, inject + 2000, layout)
    # Rises like a benign bump but settles at 50-70% of its peak instead of recovering.
    peak = float(rng.uniform(0.3, 0.5))
    keep = float(rng.uniform(0.5, 0.7))
    run.add_loss_bump(inject, peak * (1 - keep), int(rng.integers(0, 51)), float(rng.uniform(40, 100)))
    run.log_loss += peak * keep * _ramp(run.n, inject, inject + 30)
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name), injected_step=inject,
        expect_kinds=("loss_divergence",), expect_page=True,
    )


def _loss_bump_recurring(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(2000, 3000))
    run = _Run(rng, inject + 5000, layout)
    # Bumps that each recover, but keep coming back (600-1,500 steps after the previous one).
    at = inject
    for _ in range(3):
        run.add_loss_bump(at, float(rng.uniform(0.3, 0.5)), int(rng.integers(0, 51)), float(rng.uniform(40, 100)))
        at += int(rng.integers(600, 1500))
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name), injected_step=inject,
        expect_kinds=("loss_divergence",), expect_page=True,
    )


def _loss_ramp(*, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout) -> Scenario:
    inject = int(rng.integers(3000, 5000))
    run = _Run(rng, inject + 12_000, layout)
    # A steady climb that would reach 2-4x the loss over 30k-40k steps; the run stops long before.
    span = float(rng.uniform(30_000, 40_000))
    run.log_loss += math.log(float(rng.uniform(2.0, 4.0))) * np.clip(np.arange(run.n) - inject, 0, None) / span
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name), injected_step=inject,
        expect_kinds=("loss_trend",),
    )


def _fp8_headroom_exhaustion(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(1500, 2500))
    margin = float(rng.uniform(2.5, 3.5))
    rate = float(rng.uniform(0.5, 1.0)) / 1000  # bits per step
    zero = inject + int(margin / rate)
    move = zero + 300  # clipping starts at zero headroom; the loss follows
    run = _Run(rng, move + 400, layout)
    layer = int(rng.integers(0, layout.layers))
    k = run.tensor_index(f"layers.{layer}.mlp.fc1", "input")
    # The scale leaves `margin` bits; from `inject` the amax outgrows it steadily.
    run.headroom_offset[k] = margin - rate * np.clip(np.arange(run.n) - inject, 0, None)
    t = np.arange(run.n, dtype=float)
    run.log_loss += 0.6 * (np.clip(t - move, 0, None) / 300) ** 2
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name), injected_step=inject,
        loss_move_step=move, expect_subject=f"layers.{layer}.mlp.fc1:input",
        expect_kinds=("fp8_headroom_trend",), expect_page=True,
    )


def _fp8_sporadic_saturation(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    inject = int(rng.integers(6500, 7500))  # late in training (Fishman et al. 2024), after a clean history
    run = _Run(rng, inject + 5000, layout)
    layer = int(rng.integers(0, layout.layers))
    k = run.tensor_index(f"layers.{layer}.mlp.fc1", "input")
    # Outliers 1.6-2.5 bits above the history, ~1 per 150 steps, at least 50 steps apart: dozens
    # over thousands of steps, never three within 100 (the clipping test cannot see them).
    at = inject
    while True:
        at += 50 + int(rng.exponential(100))
        if at >= run.n:
            break
        run.log2_amax[k, at] += float(rng.uniform(1.6, 2.5))
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name), injected_step=inject,
        expect_subject=f"layers.{layer}.mlp.fc1:input", expect_kinds=("fp8_saturation_rate",),
    )


def _slow_stage_10pct(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 4000, layout)
    inject = int(rng.integers(1500, 2500))
    stage = int(rng.integers(0, layout.pp))
    mine = run.stage == stage
    # 10-12% slower than the other stages (not than itself: stages start up to 6% apart).
    target = float(rng.uniform(1.10, 1.12))
    before = float(np.median(run.compute[:inject, ~mine])) / float(np.median(run.compute[:inject, mine]))
    run.compute[inject:, mine] *= target * before
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name, mfu_ref_end=inject),
        injected_step=inject, expect_kinds=("stage_imbalance",), expect_subject=str(stage),
        forbid_kinds=("straggler", "straggler_intermittent"),
    )


def _shared_host_straggler(
    *, rng: np.random.Generator, name: str, family: str, seed: int, layout: Layout
) -> Scenario:
    run = _Run(rng, 4000, layout)
    run.add_contention()
    inject = 40  # slowed on purpose from step 40, inside the warm-up
    rank = int(rng.integers(0, layout.world))
    run.compute[inject:, rank] *= float(rng.uniform(1.15, 1.3))
    return _scenario(
        run, name=name, family=family, seed=seed, series=run.build(name=name), injected_step=inject,
        expect_kinds=("straggler",), expect_subject=str(rank), expect_page=True,
        forbid_kinds=("stage_imbalance",),
    )


_FAMILIES = {
    "healthy_loss_bump": _healthy_loss_bump,
    "healthy_shared_host": _healthy_shared_host,
    "healthy_long": _healthy_long,
    "loss_bump_persistent": _loss_bump_persistent,
    "loss_bump_recurring": _loss_bump_recurring,
    "loss_ramp": _loss_ramp,
    "fp8_headroom_exhaustion": _fp8_headroom_exhaustion,
    "fp8_sporadic_saturation": _fp8_sporadic_saturation,
    "slow_stage_10pct": _slow_stage_10pct,
    "shared_host_straggler": _shared_host_straggler,
    "healthy_plain": _healthy_plain,
    "healthy_burst": _healthy_burst,
    "healthy_resume": _healthy_resume,
    "healthy_end_rise": _healthy_end_rise,
    "healthy_heavy_tail": _healthy_heavy_tail,
    "healthy_phase_change": _healthy_phase_change,
    "late_divergence": _late_divergence,
    "fp8_amax_creep": _fp8_amax_creep,
    "fp8_jump": _fp8_jump,
    "straggler": _straggler,
    "intermittent_straggler": _intermittent_straggler,
    "slow_stage": _slow_stage,
    "mfu_gap": _mfu_gap,
    "checkpoint_failed": _checkpoint_failed,
    "stalled": _stalled,
    "nonfinite_grads": _nonfinite_grads,
}


# --------------------------------------------------------------------------- wire format


def _opt(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


SCENARIO_PROJECT = "synthetic"
"""The project of every scenario's registration: its runs are stored under "synthetic/<run>"."""


def scenario_key(run: str) -> str:
    """The key a scenario's run is stored under (service/store/run_keys.py)."""
    return run_keys.run_key(SCENARIO_PROJECT, run)


def registration_for(sc: Scenario, *, baseline_run: str | None = None) -> RunRegistration:
    """The run registration the synthetic job would send (naming `baseline_run`, if given)."""
    lay = sc.layout
    s = sc.series
    return RunRegistration(
        run=s.run,
        project=SCENARIO_PROJECT,
        baseline_run=baseline_run,
        started_at=T0,
        model=ModelDims(layers=lay.layers, params=lay.params, non_embedding_params=lay.params),
        parallelism=Parallelism(world_size=lay.world, pp=lay.pp, dp=lay.dp),
        hardware=Hardware(
            gpu_type="H100-SXM",
            gpu_count=lay.world,
            gpus_per_node=lay.ranks_per_node,
            peak_flops=lay.peak_flops,
        ),
        # A run whose tensors are all shadows (bf16/fp32 with the what-if monitor) has no FP8 recipe.
        fp8=Fp8Recipe(
            enabled=not (s.tensors and all(t.shadow for t in s.tensors)),
            history_len=int(lay.history_len),
            margin=0,
            amax_algo="max",
        ),
        checkpoint=CheckpointSettings(
            interval_steps=lay.checkpoint_every, interval_seconds=s.checkpoint_interval_seconds
        ),
        flops_convention="6N per token, no recompute",
        tags={"scenario": sc.family, "seed": str(sc.seed)},
    )


def _step_records(sc: Scenario, rank: int, rows: np.ndarray) -> list[Any]:
    s, rs, lay = sc.series.steps, sc.series.ranks, sc.layout
    assert rs is not None
    stage = int(rs.pp_stage[rank])
    last_stage = stage == lay.pp - 1
    out: list[Any] = []
    for i in rows.tolist():
        loss = float(s.loss[i]) if last_stage else None  # only the last pipeline stage computes the loss
        if (
            loss is not None
            and math.isnan(loss)
            and not (s.loss_nonfinite is not None and s.loss_nonfinite[i])
        ):
            loss = None
        out.append(
            StepRecord(
                step=int(s.steps[i]),
                ts=float(s.ts[i]),
                step_seconds=float(rs.step_seconds[i, rank]),
                compute_seconds=float(rs.compute_seconds[i, rank]),
                wait_seconds=float(rs.wait_seconds[i, rank]),
                loss=loss,
                tokens=int(s.tokens[i] / lay.dp),  # its replica's batch, as every stage of it reports
                flops=float(s.flops[i] / lay.world),  # its own part of the job's FLOPs
                grad_norm=float(s.grad_norm[i]),
                pp_stage=stage,
                dp_rank=rank % lay.dp,
            )
        )
        out += _grad_records(sc, rank, i)
        out += _tensor_records(sc, rank, i)
    return out


def _grad_records(sc: Scenario, rank: int, i: int) -> list[Any]:
    g = sc.series.groups
    assert g is not None
    step = int(sc.series.steps.steps[i])
    out: list[Any] = []
    sq = g.norms[i] ** 2
    nonfinite = ~np.isfinite(sq)
    # DDP-like: every rank holds every gradient (local_sq), rank 0 owns them (owned_sq).
    for name, v, bad in zip(g.groups, sq.tolist(), nonfinite.tolist(), strict=True):
        out.append(
            GradRecord(
                step=step, group=name, owned_sq=v if rank == 0 else 0.0, local_sq=v, nonfinite=int(bad) * 37
            )
        )
    total = float(np.sum(sq))
    out.append(
        GradRecord(
            step=step,
            group=GLOBAL_GROUP,
            owned_sq=total if rank == 0 else 0.0,
            local_sq=total,
            nonfinite=int(nonfinite.sum()) * 37,
        )
    )
    return out


def _tensor_records(sc: Scenario, rank: int, i: int) -> list[Any]:
    lay = sc.layout
    # One data-parallel replica (dp_rank 0 of each stage) sends the full vectors of its stage's layers.
    if rank % lay.dp != 0:
        return []
    stage = rank // lay.dp
    per_stage = math.ceil(lay.layers / lay.pp)
    out: list[Any] = []
    for ts in sc.series.tensors:
        layer = int(layer_of(ts.tensor).split(".")[1])
        if layer // per_stage != stage:
            continue
        amax = float(ts.amax[i])
        nf = float(ts.nonfinite[i])
        h = float(ts.headroom_bits[i])
        out.append(
            TensorRecord(
                step=int(ts.steps[i]),
                tensor=ts.tensor,
                role=ts.role,  # type: ignore[arg-type]
                format=ts.format,  # type: ignore[arg-type]
                amax=amax,
                scale=FP8_MAX[ts.format] / (amax * 2.0**-h)
                if math.isfinite(amax) and math.isfinite(h)
                else None,
                headroom_bits=_opt(h),
                lag_bits=_opt(float(ts.lag_bits[i])),
                sat_frac=_opt(float(ts.sat_frac[i])),
                underflow_frac=_opt(float(ts.underflow_frac[i])),
                crest_bits=None if ts.crest_bits is None else _opt(float(ts.crest_bits[i])),
                nonfinite=None if math.isnan(nf) else int(nf),
                shadow=ts.shadow,
            )
        )
    return out


def _incarnation(sc: Scenario, step: int) -> int:
    inc = 0
    for at, k in sorted(sc.incarnation_from.items()):
        if step >= at:
            inc = k
    return inc


def to_wire_lines(sc: Scenario, *, steps_per_batch: int = 100, baseline_run: str | None = None) -> Iterator[str]:
    """The scenario as wire-format v1 JSON lines: the RunRegistration (naming `baseline_run`, if
    given), then per rank a Batch every `steps_per_batch` steps, (rank, incarnation, seq) numbered as
    the agent does (a resume starts a new incarnation with seq 0). Checkpoint and event records
    travel with rank 0. This is what `trainvitals replay FILE` ingests; write the lines to a file."""
    s = sc.series
    yield registration_for(sc, baseline_run=baseline_run).model_dump_json()
    n = len(s.steps.steps)
    ts = s.steps.ts
    ckpts = sorted(s.checkpoints, key=lambda c: c.ts)
    events = sorted(s.events, key=lambda e: e.ts)
    inc_of = np.array([_incarnation(sc, int(st)) for st in s.steps.steps])
    seq: dict[tuple[int, int], int] = {}
    for a in range(0, n, steps_per_batch):
        rows = np.arange(a, min(a + steps_per_batch, n))
        for inc in np.unique(inc_of[rows]).tolist():
            part = rows[inc_of[rows] == inc]
            # Side records belong to the batch whose steps' time span contains them.
            lo = float(ts[part[0] - 1]) if part[0] > 0 else -math.inf
            hi = float(ts[part[-1]]) if part[-1] < n - 1 else math.inf
            side: list[Any] = [
                CheckpointRecord(
                    step=c.step,
                    generation=c.generation,
                    status=c.status,  # type: ignore[arg-type]
                    ts=c.ts,
                    stall_seconds=c.stall_seconds,
                    persist_seconds=c.persist_seconds,
                )
                for c in ckpts
                if lo < c.ts <= hi
            ]
            side += [
                EventRecord(ts=e.ts, step=e.step, event=e.event, detail=e.detail)  # type: ignore[arg-type]
                for e in events
                if lo < e.ts <= hi
            ]
            for rank in range(sc.layout.world):
                records = _step_records(sc, rank, part) + (side if rank == 0 else [])
                k = seq.get((rank, inc), 0)
                seq[(rank, inc)] = k + 1
                yield Batch(
                    run=s.run, rank=rank, incarnation=inc, seq=k, sent_at=float(ts[part[-1]]), records=records
                ).model_dump_json()


# --------------------------------------------------------------------------- scoring


@dataclass(kw_only=True, slots=True, frozen=True)
class Outcome:
    """How the detectors did on one scenario."""

    scenario: str
    family: str
    seed: int
    healthy: bool
    detected: bool
    """A finding of an expected kind (and subject) raised at or after the injection."""
    kind: str | None
    """The earliest such finding's kind."""
    onset_step: int | None
    detected_step: int | None
    injected_step: int | None
    loss_move_step: int | None
    lead_steps: int | None
    """loss_move_step - detected_step (paged_step when the scenario expects a page): steps of
    warning before the loss moves."""
    paged_step: int | None = None
    """When the earliest expected finding paged (None: it did not)."""
    pages: tuple[str, ...]
    """Kinds of every page raised."""
    tickets: tuple[str, ...]
    """Kinds of every ticket raised (open or closed)."""
    open_tickets: tuple[str, ...] = ()
    """Kinds of the tickets still open at the run's last step."""
    misdiagnosed: tuple[str, ...]
    """Forbidden kinds that were raised (e.g. a rank straggler for a slow stage)."""


def score(sc: Scenario, findings: list[Finding]) -> Outcome:
    """Compare findings with what was injected."""
    hits = [
        f
        for f in findings
        if f.kind in sc.expect_kinds
        and (sc.expect_subject is None or f.subject == sc.expect_subject)
        and sc.injected_step is not None
        and (f.detected_step if f.detected_step is not None else f.last_step) >= sc.injected_step
        and (not sc.expect_page or f.paged_step is not None)
    ]
    first = min(hits, key=lambda f: (f.detected_step or f.last_step, f.onset_step)) if hits else None
    det = (first.detected_step or first.last_step) if first else None
    warned = first.paged_step if (first is not None and sc.expect_page) else det
    lead = sc.loss_move_step - warned if (warned is not None and sc.loss_move_step is not None) else None
    # A page of the expected kind naming another subject (a rank, a tensor) sends on-call to the
    # wrong place: a misdiagnosis as much as a forbidden kind.
    wrong = {
        f"{f.kind}@{f.subject}"
        for f in findings
        if f.severity == "page" and f.kind in sc.expect_kinds
        and sc.expect_subject is not None and f.subject != sc.expect_subject
    }
    return Outcome(
        scenario=sc.name,
        family=sc.family,
        seed=sc.seed,
        healthy=sc.healthy,
        detected=first is not None,
        kind=first.kind if first else None,
        onset_step=first.onset_step if first else None,
        detected_step=det,
        injected_step=sc.injected_step,
        loss_move_step=sc.loss_move_step,
        lead_steps=lead,
        pages=tuple(sorted(f.kind for f in findings if f.severity == "page")),
        tickets=tuple(sorted(f.kind for f in findings if f.severity == "ticket")),
        open_tickets=tuple(sorted(f.kind for f in findings if f.severity == "ticket" and f.active)),
        misdiagnosed=tuple(sorted({f.kind for f in findings if f.kind in sc.forbid_kinds} | wrong)),
        paged_step=first.paged_step if first else None,
    )


def prefix(series: RunSeries, last_step: int) -> RunSeries:
    """The run as a live collector saw it when `last_step` had just arrived (every per-step array cut
    after it; `now` one typical step later). Detectors are causal, so findings detected at or before
    `last_step` come out the same on the prefix."""
    s = series.steps
    keep = s.steps <= last_step
    k = int(keep.sum())

    def cut(a: np.ndarray | None) -> np.ndarray | None:
        return None if a is None else a[:k]

    steps = RunSteps(steps=s.steps[:k], loss=s.loss[:k], grad_norm=s.grad_norm[:k],
                     grad_nonfinite=s.grad_nonfinite[:k], step_seconds=s.step_seconds[:k], ts=s.ts[:k],
                     tokens=s.tokens[:k], flops=s.flops[:k], mfu=cut(s.mfu),
                     loss_nonfinite=cut(s.loss_nonfinite))
    end_ts = float(s.ts[k - 1]) if k else -math.inf
    groups = None
    if series.groups is not None:
        g = series.groups
        gk = int((g.steps <= last_step).sum())
        groups = GroupGradNorms(steps=g.steps[:gk], groups=list(g.groups), norms=g.norms[:gk])
    tensors = []
    for ts in series.tensors:
        tk = int((ts.steps <= last_step).sum())
        tensors.append(TensorSeries(
            tensor=ts.tensor, role=ts.role, format=ts.format, steps=ts.steps[:tk], amax=ts.amax[:tk],
            headroom_bits=ts.headroom_bits[:tk], lag_bits=ts.lag_bits[:tk], sat_frac=ts.sat_frac[:tk],
            underflow_frac=ts.underflow_frac[:tk], nonfinite=ts.nonfinite[:tk],
            crest_bits=None if ts.crest_bits is None else ts.crest_bits[:tk], shadow=ts.shadow,
            history_len=ts.history_len,
        ))
    ranks = None
    if series.ranks is not None:
        r = series.ranks
        rk = int((r.steps <= last_step).sum())
        ranks = RankSteps(steps=r.steps[:rk], ranks=r.ranks, step_seconds=r.step_seconds[:rk],
                          compute_seconds=r.compute_seconds[:rk], wait_seconds=r.wait_seconds[:rk],
                          pp_stage=r.pp_stage, node=list(r.node))
    typical = float(np.median(s.step_seconds[max(k - 100, 0) : k])) if k else 0.0
    return RunSeries(
        run=series.run, steps=steps, groups=groups, tensors=tensors, ranks=ranks,
        checkpoints=[c for c in series.checkpoints if c.ts <= end_ts],
        events=[e for e in series.events if e.ts <= end_ts],
        expected_mfu=series.expected_mfu, peak_flops_total=series.peak_flops_total,
        checkpoint_interval_seconds=series.checkpoint_interval_seconds, now=end_ts + typical,
        warmup_steps=series.warmup_steps,
    )
