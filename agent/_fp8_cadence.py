"""How often the shadow FP8 tier samples, decided once from what its samples cost on this machine.

A shadow sample reads every monitored input, weight and grad_output once (fp8.md tier 1). On a GPU
that is a few percent of one step's memory traffic; on a CPU host with slow memory the same reads
took 8.7 ms of a 113 ms step (a Xeon whose sampled steps cost three times a Zen 4's, on the same
model: docs/performance-agent.md), 0.39% of every step at one sample in 20 before anything else
the agent does. So after a short warm-up the agent compares the mean cost of a sample with the
median step and, when sampling every `fp8_every_steps` would take more than `fp8_cost_budget` of
the step time, samples every 2x or 4x that instead, and says so once. Decided once, not tracked:
the tensors' series keep one spacing, and load moves the step and the reads alike (that Xeon
at half speed an hour later: 15.2 ms of a 241 ms step, the same choice). Powers of two of the base, so
ranks that decide differently still sample common steps (every 4x step is a 2x and a 1x step).
"""

from __future__ import annotations

import math
import statistics

WARMUP_SAMPLES = 5
"""Samples taken at the configured cadence before deciding; the first (allocations, first touch of
every buffer) is not counted."""

MAX_FACTOR = 4
"""At most 4x fp8_every_steps (80 steps at the default): the reference's tier 2 runs every 10-100
steps, and the cheap tier should not be rarer than that."""


class Fp8Cadence:
    """Collects the sampled steps' cost and the other steps' durations until it decides."""

    def __init__(self, every: int, budget: float) -> None:
        self.every = every
        self.budget = budget
        self.decided = budget <= 0  # a budget of 0 keeps the configured cadence
        self.sample_cost = self.step_seconds = math.nan  # what the decision saw (set by choose)
        self._samples = 0
        self._costs: list[float] = []
        self._steps: list[float] = []

    def note(self, step_seconds: float, sampled: bool, cost_seconds: float) -> int | None:
        """One step: its duration, whether the shadow hooks measured it and what they spent in it.
        Returns the new cadence when this step decides a different one."""
        if self.decided:
            return None
        if not sampled:
            self._steps.append(step_seconds)
            return None
        self._samples += 1
        if self._samples > 1:
            self._costs.append(cost_seconds)
        if self._samples < WARMUP_SAMPLES:
            return None
        self.decided = True
        every = self.choose(statistics.fmean(self._costs), statistics.median(self._steps or [math.inf]))
        self._costs, self._steps = [], []
        if every == self.every:
            return None
        self.every = every
        return every

    def choose(self, sample_cost: float, step_seconds: float) -> int:
        """The smallest of every, 2x, 4x whose amortised cost fits the budget (4x when none does)."""
        self.sample_cost, self.step_seconds = sample_cost, step_seconds
        factor = 1
        while factor < MAX_FACTOR and sample_cost > self.budget * step_seconds * self.every * factor:
            factor *= 2
        return self.every * factor

    def notice(self, base: int) -> str:
        """The line said once when the cadence widens."""
        share = self.sample_cost / (self.step_seconds * base)
        return (
            f"FP8 shadow sampling every {self.every} steps instead of every {base}: a sample's reads cost "
            f"{self.sample_cost * 1e3:.1f} ms here, {share:.2%} of a {self.step_seconds * 1e3:.1f} ms step at "
            f"every {base}, over fp8_cost_budget={self.budget:g}; AgentConfig(fp8_cost_budget=0) keeps every {base}"
        )
