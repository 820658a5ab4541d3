"""The agents attached in this process: a new attach() closes an earlier one of the same run or
the same model first, with one line that says so.

A notebook user who re-runs the attach cell, or a script that attaches inside a function it calls
twice, would otherwise leave the first agent's hooks on the model and its optimizer: its FP8
shadow hooks stay registered in whatever state its last step() left them (on, one step in
`fp8_every_steps`), so every forward pays a sampled step's amax pass from then on, and both agents
report as the same rank of the same run. Two models in one job (a GAN's generator and
discriminator) under one run id collide the same way: one rank, two step counters.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from trainvitals.agent._agent import Agent


def _first_parameter(model: nn.Module | None) -> nn.Parameter | None:
    # The model by its first parameter, which a DDP or torch.compile wrapper built around it again
    # shares (the wrapper itself is a new object).
    return next(iter(model.parameters()), None) if model is not None else None


class _Entry:
    __slots__ = ("agent", "first_parameter")

    def __init__(self, agent: Agent, model: nn.Module | None) -> None:
        self.agent = agent
        first = _first_parameter(model)
        # Weak: a dropped model is not kept alive (nor its id reused) by this.
        self.first_parameter = weakref.ref(first) if first is not None else None

    def supersedes(self, run: str, rank: int, model: nn.Module | None) -> bool:
        if self.agent.run == run and self.agent.rank == rank:
            return True  # one process is one rank of a run
        mine = self.first_parameter() if self.first_parameter is not None else None
        return mine is not None and _first_parameter(model) is mine


_open: list[_Entry] = []


def earlier_agents(run: str, rank: int, model: nn.Module | None) -> list[Agent]:
    """The open agents of this process that a new agent for (run, rank, model) supersedes: the
    same run and rank (one process is one rank of a run), or the same model under any run."""
    return [e.agent for e in _open if e.supersedes(run, rank, model)]


def register(agent: Agent, model: nn.Module | None) -> None:
    _open.append(_Entry(agent, model))


def forget(agent: Agent) -> None:
    _open[:] = [e for e in _open if e.agent is not agent]


def superseded_notice(earlier: Agent) -> str:
    """The line a superseding attach() logs: what was closed, why, and what to do for two models."""
    return (
        f"closed the agent attached earlier in this process (run {earlier.run!r}, rank {earlier.rank}, "
        f"{earlier.stats()['steps']} steps) before attaching this one: one agent per model and per rank of a run "
        "(re-running the attach cell does this); to watch two models in one process, give each "
        "its own run id"
    )
